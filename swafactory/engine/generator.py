"""The generate payload on the serving core (`swafactory.serving.scheduler`): greedy (speculative)
decoding on HF model definitions.

The scheduler admits requests up to ``workload.max_running_requests``, prefills in chunks,
decodes (``spec=none``) or runs one step of the spec table (`swafactory.serving.speculative.SpecStep`),
finishes requests and evicts out-of-window SWA slots, as it does for the conformance harness.
This payload runs each forward through a `Runner` (an HF model whose attention is the backend)
and supplies the spec table's hooks: greedy drafts (a tree grows by the draft's top-k, its
greedy child first) and greedy acceptance (the drafted token must be the target's argmax).

A request's ``tokens`` are its prompt and generated tokens; positions ``[0, committed)`` have K/V
in the pools, and ``tokens[committed]`` (the root of the next step) is generated but not yet
attended over.

Device and host: a forward's input ids that an earlier forward made (a decode's last token, a
draft chain's nodes, the verify's nodes) are read from that forward's argmax on the device;
the host gets its values only through `readback.Readback`. Without ``run.overlap`` each
readback is waited for right after its forward; with it, one forward late (after the next
forward was planned and launched), or earlier where a host decision needs it: a tree's next
level, and a step's accept lengths, which a chain that writes its own draft pool hides behind
a draft_extend over every verified node (sglang spec v2's fixed shape). Output lengths are
counted on the host (``GenReq.pending``), so stopping needs no token value.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence

import torch

from swafactory.models.build import model_dtype
from swafactory.drafts.distill import MASK_TOKEN
from swafactory.drafts.features import FeatureBook
from swafactory.serving.readback import Readback, pinned_ids
from swafactory.engine.draft_trace import fingerprint
from swafactory.engine.report_model import GenStep
from swafactory.engine.requests import (GenReq, argmax_tie, logit_gap, pack_ids, rejection,
                                        tie_tolerance)
from swafactory.engine.runner import NonFinite, Runner
from swafactory.metadata.batch import ForwardMode, ReqForward
from swafactory.serving.scheduler import Payload, Scheduler, StepKind
from swafactory.serving.parts import Parts
from swafactory.serving.speculative import greedy_path, level_bounds

__all__ = ["GenReq", "Generator", "MASK_TOKEN", "logit_gap", "rejection", "tie_tolerance"]


class Generator(Payload):
    """Every request through the scheduler (``core``) until it has generated its tokens;
    ``on_step(generator)`` after each step."""

    frozen_query = "mtp"

    def __init__(self, parts: Parts[Runner], prompts: list[list[int]], outs: list[int],
                 on_step: Callable[[Generator], None] | None = None, trace: bool = False
                 ) -> None:
        self.p, self.cfg = parts, parts.cfg
        self.trace = trace  # keep every draft pass's top logits (`GenReq.draft_trace`)
        self.by_id: dict[Hashable, GenReq] = {}
        self.history: list[GenStep] = []
        self.current = ("-", "setup")
        self.on_step = on_step
        s = self.cfg.spec
        self.tie = tie_tolerance(model_dtype(self.cfg))
        self.nodes: dict[Hashable, list[int]] = {}     # this step's node tokens, host (as known)
        self.scores: dict[Hashable, list[float]] = {}  # a tree's cumulative log-probs
        # on the device, what later forwards read: each request's last token ([1] int64), this
        # step's node tokens ([nodes] int64), the verify's argmax ([verify nodes] int64)
        self.roots: dict[Hashable, torch.Tensor] = {}
        self.dnodes: dict[Hashable, torch.Tensor] = {}
        self.vids: dict[Hashable, torch.Tensor] = {}
        # host copies that came back: a tree level's or a verify's logits rows, verify's argmax
        self.hrows: dict[Hashable, torch.Tensor] = {}
        self.hbest: dict[Hashable, list[int]] = {}
        self.overlap = self.cfg.run.overlap
        self.inflight: deque[Readback] = deque()
        self.launched = 0  # forwards launched
        self.resolved_at: list[tuple[int, int, str]] = []  # (forward waited for, launched, why)
        self.verified = 0  # the last target_verify's forward number
        self.extending = self.extended = False  # the early draft_extend (overlap, chains)
        dev, d = parts.target.device, parts.draft
        # a DFlash block's mask token: the draft's own (a saved drafter names it), else ours
        self.mask = getattr(d.model, "mask_token_id", MASK_TOKEN) if d else MASK_TOKEN
        self.masks = torch.full((max(0, s.block_size - 1) if s.algorithm == "dflash" else 0,),
                                self.mask, dtype=torch.long, device=dev)
        self.proposals: dict[Hashable, dict[int, torch.Tensor]] = {}  # node → the draft's row
        # a feature draft (EAGLE, EAGLE-3, MTP, DFlash) reads hidden states, kept on the device
        self.fb = None if d is None or not d.reads_features else FeatureBook(
            d.model.feature_width, d.device, next(d.model.parameters()).dtype,
            shifted=d.model.shifted)
        self.core = Scheduler(parts, self, (GenReq(i, pr, o) for i, (pr, o)
                                            in enumerate(zip(prompts, outs))))

    # ------------------------------------------------------------------ scheduler hooks
    def admitted(self, r: GenReq) -> None:
        self.by_id[r.rid] = r

    def before_spec(self, reqs: Sequence[GenReq]) -> None:
        self._seed_nodes(reqs)
        for r in reqs:
            r.spec_at.append(r.committed)

    def advanced(self, r: GenReq, n: int, kind: StepKind) -> None:
        if kind == "spec":
            r.accepts.append(n)

    def released(self, r: GenReq) -> None:
        if self.fb is not None:
            self.fb.drop(r.rid)

    def stepped(self, kind: StepKind, accepts: list[int]) -> None:
        core = self.core
        self.history.append(GenStep(
            step=core.step, kind=kind, running=len(core.running),
            accept_len=sum(accepts) / len(accepts) if accepts else None,
            accept_min=min(accepts) if accepts else None, evicted=core.step_evicted,
            swa_use=core.swa_use, full_use=core.full_use))
        if self.on_step is not None:
            self.on_step(self)

    def ended(self) -> None:
        self._drain(why="end")

    def _take(self, r: GenReq, row: torch.Tensor, pos: int, tok: int) -> None:
        """The target's logits at ``pos`` (row: [vocab] fp32, host) gave the next token ``tok``
        (the device's argmax, which later forwards read)."""
        tie = argmax_tie(row, self.tie)[1]
        r.logits[pos] = row
        if tie:
            r.ties.append(pos)
        r.tokens.append(tok)

    # ------------------------------------------------------------------ SpecHooks
    def forward(self, worker: str, mode: ForwardMode, reqs: list[ReqForward],
                check: bool = True) -> None:
        """Pack the query rows' tokens (device tensors where an earlier forward made them) and
        positions (host), launch the worker, start its readback; then, one forward late under
        ``run.overlap``, act on the earlier forwards' results. ``check`` (the harness's oracle
        sampling) is not read: what this payload checks comes back with every readback."""
        if mode == "draft_extend" and self.extended:  # ran right after the verify
            self.extended = False
            return
        runner = self.p.target if worker == "target" else self.p.draft
        self.current = (worker, mode)
        early = mode == "draft_extend" and self.extending
        pieces: list[torch.Tensor | list[int]] = []
        positions: list[int] = []
        keep: list[int] = []  # the rows whose argmax (and logits) come back
        row = 0
        for f in reqs:
            pos = f.node_positions()[f.query_from:].tolist()  # host facts, no device read
            if mode in ("draft_decode", "target_verify") or early:  # this step's nodes
                pieces.append(self.dnodes[f.rid][f.query_from:f.nodes])
            elif mode == "decode":  # the last token, as the device holds it
                pieces.append(self.roots[f.rid])
            else:  # committed or prompt tokens, known on the host: position = index
                pieces.append(self.by_id[f.rid].tokens[pos[0]:pos[-1] + 1])
            positions += pos
            if mode == "extend":
                keep += [row + f.q_len - 1] if self._completes(f) else []
            elif f.block:  # DFlash: row i drafts node i + 1
                keep += range(row, row + f.q_len - 1)
            else:
                keep += range(row, row + f.q_len)
            row += f.q_len
        ids = pack_ids(pieces, runner.device)
        feats = self.fb.inputs(mode, reqs, early) if self.fb and worker == "draft" else None
        logits = runner.forward(mode, reqs, ids, positions, self.p.slots.req_to_token.table,
                                self.p.alloc.full_id, check=False, features=feats)
        if self.fb is not None:  # the rows' features, for the draft forwards after this one
            if worker == "target" and mode in ("extend", "target_verify"):
                self.fb.target_rows(mode, reqs, self.p.draft.model.fuse(runner.features))
            elif mode == "draft_decode":
                self.fb.draft_rows(reqs, runner.features)
        every = keep == list(range(row))
        rb = Readback(f"{runner.name} {mode}", logits,
                      None if every else pinned_ids(keep, runner.device),
                      rows=self.trace or not (mode == "draft_decode" and reqs and reqs[0].block),
                      then=lambda host: self._resolved(runner, mode, reqs, host, early))
        self.launched += 1
        rb.index = self.launched
        self._on_device(mode, reqs, rb.ids_dev)
        self.inflight.append(rb)
        self._drain(keep=1 if self.overlap else 0)
        if mode == "target_verify":
            self.verified = rb.index
            if self.overlap and self.p.draft is not None and self.p.draft.writes and \
                    all(f.parents is None for f in reqs):
                # sglang's spec v2 shape: the draft extends over every verified chain node
                # before the accept lengths are back; its rows past the accepted ones are
                # dropped and its K/V there freed with the rejected slots
                self.extending = True
                self.forward("draft", "draft_extend", reqs)
                self.extending, self.extended = False, True

    def _completes(self, f: ReqForward) -> bool:
        return f.prefix_len + f.nodes == len(self.by_id[f.rid].prompt)

    def _drain(self, keep: int = 0, upto: int | None = None, why: str = "late") -> None:
        """Wait for (in launch order) every in-flight readback but the newest ``keep``, or
        those launched up to forward ``upto``; ``why`` is kept with each wait for the tests."""
        while len(self.inflight) > keep and (upto is None or self.inflight[0].index <= upto):
            rb = self.inflight.popleft()
            self.resolved_at.append((rb.index, self.launched, why))
            rb.then(rb.wait())

    def _on_device(self, mode: ForwardMode, reqs: list[ReqForward], ids: torch.Tensor) -> None:
        """What later forwards read from this one stays on the device. ids: [K] int64, the
        argmax of the kept rows in `forward`'s order."""
        k = 0
        for f in reqs:
            r = self.by_id[f.rid]
            if mode == "extend":
                if self._completes(f):
                    self.roots[f.rid], k = ids[k:k + 1], k + 1
                    r.pending += 1
            elif mode == "decode":
                self.roots[f.rid], k = ids[k:k + 1], k + 1
                r.pending += 1
            elif mode == "draft_decode" and f.block:
                self.dnodes[f.rid] = torch.cat([self.dnodes[f.rid][:1], ids[k:k + f.q_len - 1]])
                k += f.q_len - 1
            elif mode == "draft_decode" and f.parents is None:  # query node s drafts s + 1
                self.dnodes[f.rid] = torch.cat([self.dnodes[f.rid][:f.query_from + 1],
                                                ids[k + f.q_len - 1:k + f.q_len]])
                k += f.q_len
            else:
                if mode == "target_verify":
                    self.vids[f.rid] = ids[k:k + f.q_len]
                k += f.q_len

    def _resolved(self, runner, mode: ForwardMode, reqs: list[ReqForward], host,
                  early: bool) -> None:
        """Act on one forward's host values (`readback.HostResult`), in launch order. early: a
        draft_extend over a whole verified chain (only its committed rows are kept)."""
        runner.backend.raise_pending()  # guards: a position with no slot, named (read back here)
        if runner.guards and not host.finite:
            raise NonFinite(f"{runner.name} {mode}: non-finite logits (a poisoned, freed or "
                            "dummy slot was read)")
        k = 0
        for f in reqs:
            r = self.by_id[f.rid]
            n = (1 if self._completes(f) else 0) if mode == "extend" else \
                f.q_len - 1 if f.block else f.q_len
            ids, rows = host.ids[k:k + n], None if host.rows is None else host.rows[k:k + n]
            k += n
            if self.trace and n and rows is not None and mode in ("draft_decode", "draft_extend"):
                r.draft_trace.append(fingerprint(len(r.accepts), mode, rows))
            if mode == "extend" and n:
                self._take(r, rows[0], len(r.prompt) - 1, ids[0])  # the prompt's last logits
                r.pending, r.plain = r.pending - 1, r.plain + 1
            elif mode == "decode":
                self._take(r, rows[0], f.prefix_len, ids[0])
                r.pending, r.plain = r.pending - 1, r.plain + 1
            elif mode == "draft_decode":
                self._drafted(f, rows, ids)
            elif mode == "target_verify":
                self.hrows[f.rid], self.hbest[f.rid] = rows, ids
            elif mode == "draft_extend":  # kept for the draft's own check against its model
                for i, p in enumerate(range(f.prefix_len, f.prefix_len + f.nodes)):
                    if not early or p < r.committed:  # accepted by now (one step late)
                        r.draft_logits[p] = rows[i]

    def _drafted(self, f: ReqForward, rows: torch.Tensor | None, ids: list[int]) -> None:
        nodes = self.nodes.setdefault(f.rid, [])
        if f.block:  # DFlash: row i drafts node i + 1
            nodes[1:] = ids
        elif f.parents is None:  # a chain (own pool or FROZEN_KV): query node s drafts s + 1
            del nodes[f.query_from + 1:]
            nodes.append(ids[-1])
            self.proposals.setdefault(f.rid, {})[f.query_from + 1] = rows[-1]  # for `Rejection`
        else:  # a tree level: `grow_tree` picks the next level from these rows
            self.hrows[f.rid] = rows

    def start_tree(self, reqs) -> dict[Hashable, list[int]]:
        for r in reqs:
            self.scores[r.rid] = [0.0]
        return {r.rid: [-1] for r in reqs}

    def grow_tree(self, reqs: list[ReqForward], level: int, tree) -> None:
        """The next level: the greedy child of the level's first node (so the greedy path is
        always drafted), then the best other children by cumulative log-probability."""
        s = self.cfg.spec
        if level + 1 >= s.num_steps + 1:
            return
        lo, hi = level_bounds(s.topk, level)
        self._drain(why="tree")  # the tree's shape is a host decision: its rows must be back
        for f in reqs:
            logp = self.hrows[f.rid].log_softmax(-1)  # [hi - lo, V]
            scores = self.scores[f.rid]
            cand = []
            for i in range(lo, hi):
                top = logp[i - lo].topk(s.topk)
                cand += [(scores[i] + float(v), i, int(t)) for v, t in zip(top.values, top.indices)]
            greedy = max((c for c in cand if c[1] == lo), key=lambda c: c[0])
            rest = sorted((c for c in cand if c is not greedy), key=lambda c: -c[0])
            picked = [greedy, *rest[:s.topk - 1]]
            for score, parent, tok in picked:
                tree[f.rid].append(parent)
                self.nodes[f.rid].append(tok)
                self.scores[f.rid].append(score)
            self.dnodes[f.rid] = torch.cat([self.dnodes[f.rid], pinned_ids(
                [c[2] for c in picked], self.dnodes[f.rid].device)])

    def accept(self, verify: ReqForward) -> list[int]:
        self._drain(upto=self.verified, why="accept")  # a host decision (see module doc)
        r = self.by_id[verify.rid]
        rows, best = self.hrows[verify.rid], self.hbest[verify.rid]
        nodes = self.nodes[verify.rid][:verify.nodes]
        path = greedy_path(verify.parents, nodes, best)
        if self.fb is not None:
            self.fb.accepted(r.rid, path)
        depth = verify.node_positions() - verify.prefix_len
        for i in path[1:]:  # the accepted drafts are the target's argmax at their parents
            parent = verify.parents[i] if verify.parents is not None else i - 1
            self._record(r, rows[parent], verify.prefix_len + int(depth[parent]))
            r.tokens.append(nodes[i])
        self._take(r, rows[path[-1]], verify.prefix_len + int(depth[path[-1]]),
                   best[path[-1]])  # the bonus
        self.roots[r.rid] = self.vids[r.rid][path[-1]:path[-1] + 1]
        j = len(path)  # a chain's first rejected node: the draft's row that proposed it, kept
        if verify.parents is None and j < verify.nodes and not verify.block:
            r.rejections.append(rejection(len(r.accepts), verify.prefix_len + j - 1, rows[j - 1],
                                          self.proposals.get(r.rid, {}).get(j), nodes[j]))
        return path

    def _record(self, r: GenReq, row: torch.Tensor, pos: int) -> None:
        r.logits[pos] = row.detach().cpu()
        if argmax_tie(row, self.tie)[1]:
            r.ties.append(pos)

    def on_commit(self, rid, committed: int, path: list[int]) -> None:
        return None

    def _seed_nodes(self, reqs: Sequence[GenReq]) -> None:
        """Each step's nodes start at the root (a DFlash block: the root, then mask tokens)."""
        dflash = self.cfg.spec.algorithm == "dflash"
        for r in reqs:
            # the root's host value may still be in flight: no host decision compares it
            self.nodes[r.rid] = [-1] + [self.mask] * len(self.masks)
            self.dnodes[r.rid] = self.roots[r.rid]
            self.proposals.pop(r.rid, None)
            if dflash:
                self.dnodes[r.rid] = torch.cat([self.roots[r.rid], self.masks])

"""A wheel installed outside the checkout finds its configs (`python -m swafactory run=plan` from /tmp)."""
from __future__ import annotations

import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest
REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_installed_wheel_finds_its_configs(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    built = _run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps",
                  "--no-build-isolation", "-q", "-w", str(dist)], tmp_path)
    assert built.returncode == 0, built.stderr
    (wheel,) = dist.glob("swafactory-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # The wheel itself goes into the fresh venv; its dependencies (torch, hydra, pydantic) are
    # borrowed from this interpreter's site-packages, appended after the venv's own, so the
    # checkout (an editable install here) can never shadow the installed package.
    purelib = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   tmp_path).stdout.strip()
    Path(purelib, "zz_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    inst = _run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], tmp_path)
    assert inst.returncode == 0, inst.stderr
    where = _run([str(py), "-c", "import swafactory, swafactory.config.paths as p; "
                  "print(swafactory.__file__); print(p.conf_dir())"], tmp_path)
    pkg_file, conf = where.stdout.split()
    assert pkg_file.startswith(str(env_dir)) and conf.startswith(str(env_dir)), where.stdout
    assert Path(conf, "model", "gemma4.yaml").is_file()
    # the CUDA kernels ship as source, compiled on first use: the wheel must carry the .cu files
    for name in ("verify_d512.cu", "decode_d64.cu", "decode_fp8.cu", "decode_common.cuh"):
        cu = Path(pkg_file).parent / "kernels" / "cuda" / name
        assert cu.is_file(), f"{cu} is missing from the wheel"
    out = _run([str(py), "-m", "swafactory", "run=plan", f"hydra.run.dir={tmp_path}/o"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "swafactory plan" in out.stdout and (tmp_path / "o" / "plan.json").is_file()
    script = _run([str(env_dir / "bin" / "swafactory"), "model=tiny", "backend=torch",
                   f"hydra.run.dir={tmp_path}/s"], tmp_path)
    assert script.returncode == 0, script.stderr

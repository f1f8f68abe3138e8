# Sourced by the bench/gpu_*.sh scripts before anything else they do, with their arguments:
# a first argument that starts with "-" (--help, -h, a mistyped knob) is not an OUT folder
# (nor gpu_session.sh's backend).
# Print the script's header comment and stop, so no folder named "--help" is ever made.
case ${1:-} in
-*)
    sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
    case $1 in -h|--help) exit 0 ;; *) echo "unknown option: $1" >&2; exit 2 ;; esac ;;
esac

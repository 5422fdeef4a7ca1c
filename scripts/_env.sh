# Sourced by the scripts below: makes .venv (Python 3.11) and installs the pinned stack.
# Usage: toolkit_env EXTRAS   (for example "pipelines,tf,grain,test")

# What a fresh .venv with every extra takes (torch's CUDA libraries are most of it),
# plus pip's unpacked wheels while it installs.
VENV_NEEDS_GIB=16

toolkit_env() {
  local extras="$1"
  local py="${PYTHON:-}"
  if [ -z "$py" ]; then
    for cand in python3.11 python3; do
      if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
        py="$cand"; break
      fi
    done
  fi
  [ -n "$py" ] || { echo "error: Python 3.11 not found (set PYTHON=...)" >&2; return 1; }
  if [ ! -x .venv/bin/python ]; then
    warn_low_disk "$VENV_NEEDS_GIB"
    "$py" -m venv .venv
  fi
  .venv/bin/python -m pip install --quiet --upgrade pip
  pip_install .venv/bin/python -c constraints.txt -e ".[${extras}]"
}

# pip_install PYTHON PIP_ARGS...: pip install, checked for half-installed packages and
# tried up to three times. Large wheels (torch's CUDA libraries) sometimes stop
# mid-download, and a full disk stops an install part-way; either leaves packages that
# pip takes for installed on the next try (scripts/check_venv.py says why), so every
# attempt ends by reinstalling those.
pip_install() {
  local py="$1"; shift
  local attempt
  for attempt in 1 2 3; do
    if "$py" -m pip install --quiet "$@" && repair_venv "$py"; then
      return 0
    fi
    echo "pip install failed (attempt ${attempt}/3, $(free_disk_gib) GiB free), retrying" >&2
    sleep 10
    repair_venv "$py" || true
  done
  echo "error: could not install into $(dirname "$(dirname "$py")") ($(free_disk_gib) GiB free here)" >&2
  return 1
}

# repair_venv PYTHON: reinstalls each half-installed package of that venv (not the
# project's own editable install, which every pip_install call reinstalls anyway).
repair_venv() {
  local py="$1" broken
  broken="$("$py" scripts/check_venv.py --explain | grep -v -i '^tpu[-_]shards==' || true)"
  if [ -z "$broken" ]; then
    "$py" scripts/check_venv.py >/dev/null 2>&1 || return 1  # only our own project is broken
    return 0
  fi
  echo "reinstalling half-installed packages: $(echo $broken)" >&2
  # shellcheck disable=SC2086  # one requirement per word
  "$py" -m pip install --quiet --no-deps --force-reinstall $broken || return 1
  "$py" scripts/check_venv.py --explain >/dev/null
}

free_disk_gib() {
  df -Pk . | awk 'NR == 2 { printf "%d", $4 / 1048576 }'
}

warn_low_disk() {
  local need="$1" have
  have="$(free_disk_gib)"
  if [ "$have" -lt "$need" ]; then
    echo "warning: ${have} GiB free here; a new venv needs about ${need} GiB (a full disk stops pip part-way)" >&2
  fi
}

# Sourced by the scripts below: makes .venv (Python 3.11) and installs the pinned stack.
# Usage: toolkit_env EXTRAS   (for example "pipelines,tf,grain,test")
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
    "$py" -m venv .venv
  fi
  .venv/bin/python -m pip install --quiet --upgrade pip
  pip_retry .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[${extras}]"
}

# Large wheels (torch's CUDA libraries) sometimes stop mid-download: try the install again.
pip_retry() {
  local attempt
  for attempt in 1 2 3; do
    if "$@"; then
      return 0
    fi
    echo "pip install failed (attempt ${attempt}/3), retrying" >&2
    sleep 10
  done
  return 1
}

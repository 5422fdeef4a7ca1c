# Sourced by the scripts below: makes .venv (Python 3.11) and installs the pinned stack.
# Usage: toolkit_env EXTRAS   (for example "pipelines,tf,grain,test")

# What a fresh .venv with every extra takes (torch's CUDA libraries are most of it),
# plus the installer's unpacked wheels.
VENV_NEEDS_GIB=16

# The installer is uv (pinned in constraints.txt; pip installs only uv itself): it downloads and unpacks
# wheels in parallel where pip takes one at a time. Its cache is kept in the checkout and hard-linked into
# the venvs, so that deleting a clone frees it; byte code is compiled at install, as pip does, because a
# process that may not write it (PYTHONDONTWRITEBYTECODE) would otherwise compile TensorFlow on each import.
export UV_CACHE_DIR="${UV_CACHE_DIR:-$PWD/.uv-cache}" UV_COMPILE_BYTECODE=1

# python311: prints the Python 3.11 to make venvs with ($PYTHON, else python3.11 or python3).
python311() {
  local cand
  for cand in ${PYTHON:-python3.11 python3}; do
    if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      echo "$cand"
      return 0
    fi
  done
  echo "error: Python 3.11 not found (set PYTHON=...)" >&2
  return 1
}

# new_venv DIR NEEDS_GIB: makes the venv DIR (unless it exists) with uv in it.
new_venv() {
  local dir="$1" py
  if [ ! -x "$dir/bin/python" ]; then
    warn_low_disk "$2"
    py="$(python311)" || return 1
    "$py" -m venv "$dir"
  fi
  "$dir/bin/python" -m pip install --quiet -c constraints.txt uv
}

toolkit_env() {
  new_venv .venv "$VENV_NEEDS_GIB"
  venv_install .venv/bin/python -c constraints.txt -e ".[$1]"
}

# venv_install PYTHON ARGS...: uv pip install into PYTHON's venv, checked for half-installed packages and
# tried up to three times. Large wheels (torch's CUDA libraries) sometimes stop
# mid-download, and a full disk stops an install part-way; either leaves packages that
# an installer takes for installed on the next try (scripts/check_venv.py says why), so every
# attempt ends by reinstalling those.
venv_install() {
  local py="$1"; shift
  local attempt
  for attempt in 1 2 3; do
    if "$py" -m uv pip install --quiet --python "$py" "$@" && repair_venv "$py"; then
      return 0
    fi
    echo "install failed (attempt ${attempt}/3, $(free_disk_gib) GiB free), retrying" >&2
    sleep 10
    repair_venv "$py" || true
  done
  echo "error: could not install into $(dirname "$(dirname "$py")") ($(free_disk_gib) GiB free here)" >&2
  return 1
}

# repair_venv PYTHON: reinstalls each half-installed package of that venv (not the
# project's own editable install, which every venv_install call reinstalls anyway).
repair_venv() {
  local py="$1" broken
  broken="$("$py" scripts/check_venv.py --explain | grep -v -i '^tpu[-_]shards==' || true)"
  if [ -z "$broken" ]; then
    "$py" scripts/check_venv.py >/dev/null 2>&1 || return 1  # only our own project is broken
    return 0
  fi
  echo "reinstalling half-installed packages: $(echo $broken)" >&2
  # shellcheck disable=SC2086  # one requirement per word
  "$py" -m uv pip install --quiet --python "$py" --no-deps --reinstall $broken || return 1
  "$py" scripts/check_venv.py --explain >/dev/null
}

free_disk_gib() {
  df -Pk . | awk 'NR == 2 { printf "%d", $4 / 1048576 }'
}

warn_low_disk() {
  local need="$1" have
  have="$(free_disk_gib)"
  if [ "$have" -lt "$need" ]; then
    echo "warning: ${have} GiB free here; a new venv needs about ${need} GiB (a full disk stops the install part-way)" >&2
  fi
}

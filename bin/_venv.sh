# Sourced by bin/lab and bin/test: create or reuse ./.venv and install the course into it
# with the pinned versions of requirements/constraints.txt. Usage: source bin/_venv.sh EXTRA
set -euo pipefail

COURSE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
COURSE_VENV="${COURSE_VENV:-$COURSE_ROOT/.venv}"
extra="$1"

find_python() {
    # The course needs Python >= 3.11; take the first interpreter that qualifies.
    local candidate
    for candidate in "${PYTHON:-}" python3 python3.13 python3.12 python3.11; do
        [ -n "$candidate" ] || continue
        command -v "$candidate" >/dev/null 2>&1 || continue
        if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

if [ ! -x "$COURSE_VENV/bin/python" ]; then
    if ! python_bin="$(find_python)"; then
        echo "error: the course needs Python 3.11 or newer and none was found on PATH." >&2
        echo "       Install one (e.g. 'apt-get install python3.11 python3.11-venv') or set PYTHON=/path/to/python3.11." >&2
        exit 1
    fi
    echo "Creating the virtual environment $COURSE_VENV with $("$python_bin" --version)"
    if ! "$python_bin" -m venv "$COURSE_VENV"; then
        echo "error: '$python_bin -m venv' failed. On Debian/Ubuntu install the venv module: apt-get install python3-venv" >&2
        exit 1
    fi
fi

# Reinstall only when the project or the pins changed since the last install of this extra.
stamp="$COURSE_VENV/.course-installed-$extra"
wanted="$(cat "$COURSE_ROOT/pyproject.toml" "$COURSE_ROOT/requirements/constraints.txt" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$wanted" ]; then
    echo "Installing the course and its pinned dependencies into $COURSE_VENV (first time: about 2 minutes)..."
    # pip prints one harmless warning per ignored index location on some machines: keep errors only.
    "$COURSE_VENV/bin/python" -m pip install --quiet --quiet --disable-pip-version-check \
        --constraint "$COURSE_ROOT/requirements/constraints.txt" \
        --editable "$COURSE_ROOT[$extra]"
    echo "$wanted" > "$stamp"
fi

export PATH="$COURSE_VENV/bin:$PATH"
export VIRTUAL_ENV="$COURSE_VENV"

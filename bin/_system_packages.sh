# Sourced by bin/test: the Debian packages that the grading tests need.
#   bubblewrap  the autograder's sandbox (tests/test_autograder_hostile.py, tests/test_autograder_sandbox.py)
#   postgresql  a throwaway PostgreSQL server for the gradebook test (tests/test_autograder_postgres.py)
# As root on a Debian/Ubuntu machine, missing packages are installed (one `apt-get update`, then
# `apt-get install`). Otherwise this prints what to install, and the tests that need a package skip,
# unless COURSE_REQUIRE_SYSTEM_PACKAGES=1 (as in CI, .ci/run): then a missing package stops the run.

course_system_packages() {
    local missing=()
    command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql)
    [ "${#missing[@]}" -eq 0 ] && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "Installing Debian packages for the grading tests: ${missing[*]} (about a minute, once)"
        if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
               DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
               >/tmp/course-apt.log 2>&1; then
            echo "warning: apt-get could not install ${missing[*]} (log: /tmp/course-apt.log);" \
                 "the tests that need them will be skipped." >&2
        fi
    else
        echo "note: ${missing[*]} not installed, so the sandboxed-grading and PostgreSQL tests will be skipped." >&2
        echo "      Install with: sudo apt-get install ${missing[*]}   (the grading sandbox also needs root)" >&2
    fi
}

course_system_packages
if [ "${COURSE_REQUIRE_SYSTEM_PACKAGES:-0}" = 1 ]; then
    if ! command -v bwrap >/dev/null 2>&1 || ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
        echo "error: bubblewrap and postgresql are required here (COURSE_REQUIRE_SYSTEM_PACKAGES=1) and could not" \
             "be installed; see /tmp/course-apt.log" >&2
        exit 1
    fi
fi

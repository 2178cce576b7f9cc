# shellcheck shell=bash
# Shared set-up for scripts/test, scripts/check and scripts/demo. Source it, don't run it:
#
#     source "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"
#     hypha_bootstrap            # .venv with requirements/test.txt and the project (editable), on PATH
#
# The install is skipped when the stamp file in the venv holds the hash of requirements/*.txt and
# pyproject.toml, so a second run costs a hash, not a pip resolve. Delete .venv/.hypha-install-stamp
# (or the whole .venv) to force a reinstall.
#
# Environment:
#   HYPHA_VENV     the virtual environment to use (default: <repo>/.venv)
#   HYPHA_PYTHON   the interpreter that creates it (default: python3.11)

HYPHA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HYPHA_VENV="${HYPHA_VENV:-$HYPHA_ROOT/.venv}"
HYPHA_PYTHON="${HYPHA_PYTHON:-python3.11}"
HYPHA_STAMP="$HYPHA_VENV/.hypha-install-stamp"

hypha_log() { printf '==> %s\n' "$*"; }
hypha_warn() { printf 'warning: %s\n' "$*" >&2; }
hypha_die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

# --- clean-up on exit -------------------------------------------------------------------------------
# One EXIT trap per script; hypha_on_exit adds a command to it. Commands run last-added first, so a
# process started after a temp dir was made is stopped before the dir is removed.
HYPHA_EXIT_COMMANDS=()
hypha_on_exit() { HYPHA_EXIT_COMMANDS+=("$1"); }
_hypha_run_exit_commands() {
    local status=$? index
    for ((index = ${#HYPHA_EXIT_COMMANDS[@]} - 1; index >= 0; index--)); do
        eval "${HYPHA_EXIT_COMMANDS[index]}" || true
    done
    return "$status"
}
trap _hypha_run_exit_commands EXIT
# Turn Ctrl-C and SIGTERM into a normal exit, so the EXIT trap cleans up (and the status says why).
trap 'exit 130' INT
trap 'exit 143' TERM

# hypha_temp_dir VAR PREFIX: make a fresh temp dir, store its path in VAR, remove it on exit.
hypha_temp_dir() {
    local made
    made="$(mktemp -d "${TMPDIR:-/tmp}/$2.XXXXXX")"
    printf -v "$1" '%s' "$made"
    hypha_on_exit "rm -rf '$made'"
}

# --- the virtual environment ------------------------------------------------------------------------

# The hash of everything that decides what is installed.
hypha_install_hash() {
    (cd "$HYPHA_ROOT" && sha256sum requirements/*.txt pyproject.toml | sha256sum | cut -d' ' -f1)
}

hypha_bootstrap() {
    local wanted started pip_check editable_log
    wanted="$(hypha_install_hash)"
    # scripts/test runs scripts/check: the second call in one run has nothing to do.
    if [[ "${HYPHA_BOOTSTRAPPED:-}" == "$wanted" && -x "$HYPHA_VENV/bin/python" ]]; then
        _hypha_activate
        return 0
    fi

    if [[ ! -e "$HYPHA_VENV/bin/python" ]]; then
        command -v "$HYPHA_PYTHON" >/dev/null ||
            hypha_die "$HYPHA_PYTHON not found; install Python 3.11 or set HYPHA_PYTHON to a Python 3.11 interpreter"
        hypha_log "creating the virtual environment $HYPHA_VENV ($("$HYPHA_PYTHON" -V 2>&1))"
        "$HYPHA_PYTHON" -m venv "$HYPHA_VENV"
        rm -f "$HYPHA_STAMP"
    fi
    if ! "$HYPHA_VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
        hypha_die "$HYPHA_VENV is broken or not Python 3.11 ($("$HYPHA_VENV/bin/python" -V 2>&1 || true)); remove it and run again"
    fi

    if [[ -f "$HYPHA_STAMP" && "$(cat "$HYPHA_STAMP")" == "$wanted" ]]; then
        hypha_log "dependencies up to date in $HYPHA_VENV"
    else
        started=$SECONDS
        hypha_log "installing requirements/test.txt and the project into $HYPHA_VENV"
        # A failed or interrupted install must not leave a stamp that says it succeeded.
        rm -f "$HYPHA_STAMP"
        _hypha_pip install --quiet --upgrade pip || hypha_die "could not upgrade pip in $HYPHA_VENV"
        # Fully pinned, so pip resolves nothing; torch==2.13.0 is taken from the machine's local CPU wheel.
        _hypha_pip install --quiet --progress-bar off -r "$HYPHA_ROOT/requirements/test.txt" ||
            hypha_die "pip could not install requirements/test.txt (see pip's message above)"
        # --no-deps: the lock files above are the whole dependency set; pyproject's ranges must not pull more.
        # The build backend's deprecation notices are noise on success; shown in full on failure.
        if ! editable_log="$(_hypha_pip install --quiet --progress-bar off --no-deps -e "$HYPHA_ROOT")"; then
            printf '%s\n' "$editable_log" >&2
            hypha_die "pip could not install the project itself (pyproject.toml)"
        fi
        if ! pip_check="$(_hypha_pip check)"; then
            printf '%s\n' "$pip_check" >&2
            hypha_die "pip check found missing or conflicting pins: fix requirements/*.txt"
        fi
        _hypha_install_openapi_client
        printf '%s\n' "$wanted" >"$HYPHA_STAMP"
        hypha_log "installed in $((SECONDS - started)) s"
    fi
    export HYPHA_BOOTSTRAPPED="$wanted"
    _hypha_activate
}

# openapi-python-client (tests/e2e/test_generated_client.py) in a venv of its own inside the main one: its
# typer pin conflicts with the CLI's. Made afresh with every install of the main venv.
HYPHA_OPENAPI_CLIENT_VENV="$HYPHA_VENV/tools/openapi-python-client"
_hypha_install_openapi_client() {
    rm -rf "$HYPHA_OPENAPI_CLIENT_VENV"
    "$HYPHA_VENV/bin/python" -m venv "$HYPHA_OPENAPI_CLIENT_VENV" ||
        hypha_die "could not create $HYPHA_OPENAPI_CLIENT_VENV"
    HYPHA_VENV="$HYPHA_OPENAPI_CLIENT_VENV" _hypha_pip install --quiet --progress-bar off \
        -r "$HYPHA_ROOT/requirements/openapi-client.txt" ||
        hypha_die "pip could not install requirements/openapi-client.txt (see pip's message above)"
}

# pip in the venv, without the lines this machine's pip configuration adds for every package (an extra
# index folder that does not exist), which would bury pip's real messages. Returns pip's exit code.
_hypha_pip() {
    local status=0
    "$HYPHA_VENV/bin/python" -m pip "$@" 2>&1 |
        { grep -v -e 'is ignored: it is neither a file nor a directory' || true; } || status=$?
    return "$status"
}

_hypha_activate() {
    export VIRTUAL_ENV="$HYPHA_VENV"
    case ":$PATH:" in
    *":$HYPHA_VENV/bin:"*) ;;
    *) export PATH="$HYPHA_VENV/bin:$PATH" ;;
    esac
    unset PYTHONHOME
}

# --- modes -------------------------------------------------------------------------------------------

# A URL with its password replaced by ***, for printing.
hypha_redact_url() { printf '%s\n' "$1" | sed -E 's#(://[^:/@]*):[^@/]*@#\1:***@#'; }

# One line saying which database and transports the settings will pick from the environment.
hypha_describe_mode() {
    local database transports mode
    if [[ -n "${DATABASE_URL:-}" ]]; then
        database="DATABASE_URL=$(hypha_redact_url "$DATABASE_URL")"
    else
        database="SQLite in HYPHA_DATA_DIR=${HYPHA_DATA_DIR:-<unset>}"
    fi
    if [[ -n "${REDIS_URL:-}" ]]; then
        transports="REDIS_URL=$(hypha_redact_url "$REDIS_URL") (Celery broker, channels_redis)"
    else
        transports="in-process tasks and channel layer"
    fi
    if [[ -n "${DATABASE_URL:-}" && -n "${REDIS_URL:-}" ]]; then
        mode="services"
    elif [[ -z "${DATABASE_URL:-}" && -z "${REDIS_URL:-}" ]]; then
        mode="embedded"
    else
        mode="mixed"
    fi
    printf 'mode: %s — database: %s; transports: %s\n' "$mode" "$database" "$transports"
}

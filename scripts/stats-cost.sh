#!/usr/bin/env bash
# What the relays' backlog statistics cost PostgreSQL: 1 and then 4 ordered relays
# (`--partitions 8`; or unordered ones, `MODE=unordered`) idle on a backlog of parked rows (which they leave alone), and
# PostgreSQL's CPU time per second while they run, read from /proc: every `postgres` process
# of the machine (run it on an otherwise idle server), and of those the sessions of the
# script's database alone (the relays'), which other work on the server does not touch. What
# is left is the relays' statistics readings every `--stats-interval`, each of which reads
# every unpublished row, and their idle polls and looks at the shares; with `ROWS=0`, what
# idle relays cost.
#
#   cargo build --release --bins
#   scripts/stats-cost.sh                                  # 1,000,000 rows, 30 s per run
#   ROWS=200000 SECONDS_PER_RUN=20 RELAYS="1 2 4" scripts/stats-cost.sh
#   ROWS=0 SECONDS_PER_RUN=20 scripts/stats-cost.sh        # idle relays on an empty table
#   ROWS=0 OTHER_WRITES=100 scripts/stats-cost.sh          # ... while another database is written
#   ROWS=0 MODE=unordered scripts/stats-cost.sh            # idle unordered relays (4 workers each)
#
# Environment: RELAY (target/release/outbox-relay), PG (postgres://postgres@127.0.0.1:5432, a
# superuser's URL without a database), ROWS, RELAYS, SECONDS_PER_RUN, INTERVAL (5s),
# OTHER_WRITES (0: how many transactions a second update a row of another database meanwhile,
# outbox_stats_cost_other, whose sessions the second column leaves out), MODE (ordered, with
# `--partitions 8`, or unordered, with its default 4 workers). It makes the
# database outbox_stats_cost and its own nats-server (on a free port, in a temp dir), and
# removes them at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

RELAY=${RELAY:-target/release/outbox-relay}
PG=${PG:-postgres://postgres@127.0.0.1:5432}
ROWS=${ROWS:-1000000}
RELAYS=${RELAYS:-"1 4"}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-30}
INTERVAL=${INTERVAL:-5s}
OTHER_WRITES=${OTHER_WRITES:-0}
MODE=${MODE:-ordered}
case "$MODE" in
    ordered) mode_args=(--partitions 8) ;;
    unordered) mode_args=(--mode unordered) ;;
    *) echo "MODE is ordered or unordered, not $MODE" >&2; exit 2 ;;
esac
DB=outbox_stats_cost
OTHER=${DB}_other

[ -x "$RELAY" ] || { echo "no relay at $RELAY: cargo build --release --bins" >&2; exit 2; }
command -v nats-server > /dev/null || { echo "nats-server is not on PATH" >&2; exit 2; }

dir=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2> /dev/null || true; done
    wait 2> /dev/null || true
    psql -q "$PG/postgres" -c "DROP DATABASE IF EXISTS $DB" -c "DROP DATABASE IF EXISTS $OTHER" \
        2> /dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT

psql -q "$PG/postgres" -c "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB"
for f in outbox-diesel/migrations/*/up.sql; do
    psql -q -v ON_ERROR_STOP=1 "$PG/$DB" -f "$f"
done
psql -q "$PG/$DB" -c "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, \
    parked_at) SELECT gen_random_uuid(), 'order', 'parked-' || g, 'order.placed', \
    jsonb_build_object('n', g, 'pad', repeat('x', 200)), now() FROM generate_series(1, $ROWS) g" \
    -c "VACUUM ANALYZE outbox"

if [ "$OTHER_WRITES" -gt 0 ]; then
    psql -q "$PG/postgres" -c "DROP DATABASE IF EXISTS $OTHER" -c "CREATE DATABASE $OTHER"
    psql -q "$PG/$OTHER" -c "CREATE TABLE busy (n int8 NOT NULL)" -c "INSERT INTO busy VALUES (0)"
    # each update a transaction of its own, OTHER_WRITES a second
    printf 'UPDATE busy SET n = n + 1 \\watch %s\n' "$(awk -v w="$OTHER_WRITES" 'BEGIN { print 1 / w }')" \
        | psql -q "$PG/$OTHER" > /dev/null 2>&1 &
    pids+=($!)
fi

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
nats-server -a 127.0.0.1 -p "$port" -js -sd "$dir/js" > "$dir/nats.log" 2>&1 &
pids+=($!)
sleep 1

# CPU time of every postgres process, in clock ticks; with an argument, of the sessions of
# that database only (their process title names it)
pg_ticks() {
    local total=0 p
    for p in /proc/[0-9]*; do
        [ "$(cat "$p/comm" 2> /dev/null)" = postgres ] || continue
        if [ $# -gt 0 ]; then
            tr '\0' ' ' < "$p/cmdline" 2> /dev/null | grep -q " $1 " || continue
        fi
        # utime and stime: fields 14 and 15, after the command in parentheses
        total=$((total + $(sed 's/.*) //' "$p/stat" 2> /dev/null | awk '{print $12 + $13}' || echo 0)))
    done
    echo "$total"
}
hz=$(getconf CLK_TCK)

if [ "$OTHER_WRITES" -gt 0 ]; then echo "while $OTHER writes $OTHER_WRITES transactions a second"; fi
echo "$MODE relays  rows  --stats-interval  PostgreSQL CPU ms per second: all; the relays' sessions"
for k in $RELAYS; do
    relays=()
    for _ in $(seq "$k"); do
        RUST_LOG=${RELAY_LOG:-warn} "$RELAY" run --database-url "$PG/$DB" --nats-url "nats://127.0.0.1:$port" \
            --stream STATSCOST --subject-prefix statscost "${mode_args[@]}" \
            --stats-interval "$INTERVAL" > /dev/null 2>> "${RELAY_LOG_FILE:-$dir/relays.log}" &
        relays+=($!)
        pids+=($!)
    done
    # the relays' start and first readings (a random point of the first interval)
    sleep 10
    t0=$(date +%s.%N)
    c0=$(pg_ticks)
    s0=$(pg_ticks "$DB")
    sleep "$SECONDS_PER_RUN"
    c1=$(pg_ticks)
    s1=$(pg_ticks "$DB")
    t1=$(date +%s.%N)
    for p in "${relays[@]}"; do kill -TERM "$p"; done
    for p in "${relays[@]}"; do wait "$p" 2> /dev/null || true; done
    awk -v k="$k" -v rows="$ROWS" -v i="$INTERVAL" -v c="$((c1 - c0))" -v s="$((s1 - s0))" \
        -v hz="$hz" -v t0="$t0" -v t1="$t1" \
        'BEGIN { printf "%6d  %d  %s  %.1f; %.1f\n", k, rows, i, c * 1000 / hz / (t1 - t0), s * 1000 / hz / (t1 - t0) }'
done

//! Relays sharing partitions: different roles, the largest partition count.

use super::*;

// 2. Relays running as different roles, with only the README's GRANTs: each sees the other in
// `pg_locks` (another role's `pg_stat_activity.backend_start` is NULL to it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_running_as_different_roles_share_the_partitions() {
    let db = TestDb::new();
    let stream = TestStream::new();
    let (a, b) = (Role::relay(&db), Role::relay(&db));
    let args = ["--partitions", "4"];
    let mut cmd = relay_command(&db, &stream, &args);
    cmd.env("DATABASE_URL", a.url());
    let _ra = Proc::spawn("relay-a", &mut cmd);
    let mut cmd = relay_command(&db, &stream, &args);
    cmd.env("DATABASE_URL", b.url());
    let _rb = Proc::spawn("relay-b", &mut cmd);

    wait_until(
        Duration::from_secs(20),
        "4 partitions spread 2 and 2 over the two roles' relays",
        || async {
            let per_pid = support::partitions_per_owner(&db);
            per_pid.len() == 2 && per_pid.values().all(|&n| n == 2)
        },
    )
    .await;
    // and they stay shared: no relay loops on a failing balance and drops its partitions
    tokio::time::sleep(Duration::from_secs(2)).await;
    let per_pid = support::partitions_per_owner(&db);
    assert!(
        per_pid.len() == 2 && per_pid.values().all(|&n| n == 2),
        "{per_pid:?}"
    );
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(DISTINCT usename) FROM pg_stat_activity WHERE application_name = \
             'outbox-relay' AND usename IN ('{}', '{}')",
            a.name, b.name
        )),
        2,
        "each relay runs as its own role"
    );
    record(&mut db.conn(), 200, 40);
    wait_published(&db, 200, Duration::from_secs(30)).await;
    assert_eq!(stream.count().await, 200);
}

// 8. The largest partition count: two relays share 1,024 partitions, and the membership keys
// of one table cannot be read as another's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_share_the_largest_partition_count() {
    let db = TestDb::new();
    let stream = TestStream::new();
    let max = outbox_diesel::relay::MAX_PARTITIONS.to_string();
    let args = ["--partitions", max.as_str()];
    let _r1 = Proc::spawn("relay-1", &mut relay_command(&db, &stream, &args));
    let _r2 = Proc::spawn("relay-2", &mut relay_command(&db, &stream, &args));
    wait_until(
        Duration::from_secs(60),
        "1,024 partitions spread 512 and 512",
        || async {
            let per_pid = support::partitions_per_owner(&db);
            per_pid.len() == 2 && per_pid.values().all(|&n| n == 512)
        },
    )
    .await;
    // both are members of this table with their count, and of no other table
    let mut conn = db.async_conn().await;
    let members = outbox_diesel::relay::members(&mut conn, &outbox_diesel::OutboxTable::DEFAULT)
        .await
        .expect("members");
    assert_eq!(members.len(), 2, "{members:?}");
    assert!(members.iter().all(|m| m.partitions == 1024), "{members:?}");
    assert_eq!(
        db.scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 \
             AND classid <> 'outbox'::regclass::oid \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ),
        0,
        "a membership key names another table"
    );
    record(&mut db.conn(), 300, 300);
    wait_published(&db, 300, Duration::from_secs(30)).await;
}

#[test]
fn a_partition_count_above_the_largest_is_refused_at_start() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let over = (outbox_diesel::relay::MAX_PARTITIONS + 1).to_string();
    let out = relay_command(&db, &stream, &["--partitions", over.as_str()])
        .output()
        .expect("run the relay");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--partitions 1025 is out of range 1..=1024"),
        "{stderr}"
    );
}

// 52. A relay that stops tells the others its partitions are free (`NOTIFY`), and they look
// at the shares at once; its membership lasted until its session ended, after the notice, so
// a look in between still counted it and left the partitions for the relay's next look (1 s;
// 20 s in `relays_move_the_shares_at_once_when_one_joins_or_stops`, which met it on a busy
// machine). A relay now leaves the members before it tells.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_leaves_the_members_is_not_counted_while_its_session_lives() {
    use outbox_diesel::relay::{backend_pid, join_members, leave_members, members};
    let db = TestDb::new();
    let table = outbox_diesel::OutboxTable::DEFAULT;
    let (mut a, mut b) = (db.relay_session().await, db.relay_session().await);
    let pid_a = backend_pid(&mut a).await.expect("pid");
    let ticket = join_members(&mut a, &table, 4).await.expect("a joins");
    join_members(&mut b, &table, 4).await.expect("b joins");
    let pids = |m: Vec<outbox_diesel::relay::Member>| m.iter().map(|m| m.pid).collect::<Vec<_>>();
    let both = pids(members(&mut b, &table).await.expect("members"));
    assert_eq!(both.len(), 2, "{both:?}");
    assert_eq!(both[0], pid_a, "{both:?}");
    leave_members(&mut a, &table, 4, ticket)
        .await
        .expect("a leaves");
    let left = pids(members(&mut b, &table).await.expect("members"));
    assert!(left.len() == 1 && !left.contains(&pid_a), "{left:?}");
    // and it may join again, last
    join_members(&mut a, &table, 4)
        .await
        .expect("a joins again");
    let again = pids(members(&mut b, &table).await.expect("members"));
    assert_eq!(again.last(), Some(&pid_a), "{again:?}");
}

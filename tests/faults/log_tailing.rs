//! Log tailing at its edges (8): the first start under load, a dropped slot.

use super::*;

/// The log-tailing relays start for the first time while the writer commits, and both are
/// SIGKILLed once soon after: the rows committed before the slot come from its exported
/// snapshot (published again from a new slot when the kill struck during it), the rest from
/// the slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_first_start_under_load_loses_and_duplicates_nothing() {
    let test = "first_start_log_tailing";
    let _serial = SERIAL.lock().await;
    let (db, stream, logs) = (fault_db(TestDb::new()), TestStream::new(), Logs::new(test));
    let slot = Slot::new(&db);
    let mut args = Mode::LogTailing.relay_args();
    args.extend(["--slot".to_owned(), slot.name.clone()]);
    let mut w = steady_writer(&db, &logs, SHORT);
    let before = SHORT.events as i64 / 3;
    wait_until(SHORT.timeout(), "rows before the relays", || async {
        db.scalar("SELECT count(*) FROM outbox_record") >= before
    })
    .await;
    let mut relays = Relays::start(&db, &stream, &logs, args, 2);
    wait_until(SHORT.timeout(), "the first rows published", || async {
        stream.count().await >= 100
    })
    .await;
    relays.kill_and_restart(0);
    relays.kill_and_restart(1);
    let committed = finished(&mut w, SHORT).await;
    assert_eq!(committed, SHORT.events);
    drained(&db, Some(&slot), SHORT.timeout()).await;
    drop(relays);
    let r = report(test, &db, &stream).await;
    assert_eq!(r.committed as u64, SHORT.events, "{r}");
    Mode::LogTailing.assert(&r);
}

/// The slot dropped mid-run, as a failover to a standby without it loses it: the reader and
/// the standby stop (exit 1) instead of making a new slot at the current position, and
/// restarted with `--recover-slot` they publish again what the table holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_dropped_slot_stops_the_relays_and_recovery_loses_nothing() {
    let test = "dropped_slot_log_tailing";
    let _serial = SERIAL.lock().await;
    let (db, stream, logs) = (fault_db(TestDb::new()), TestStream::new(), Logs::new(test));
    let (args, slot) = Mode::LogTailing.setup(&db);
    let slot = slot.expect("a slot");
    let mut relays = Relays::start(&db, &stream, &logs, args, 2);
    let mut w = steady_writer(&db, &logs, SHORT);
    wait_until(SHORT.timeout(), "a third of the rows published", || async {
        stream.count().await >= SHORT.events / 3
    })
    .await;
    support::slot::drop_slot(db.admin_url(), &slot.name);
    for p in &mut relays.procs {
        assert_eq!(
            p.wait_exit(Duration::from_secs(60)),
            Some(1),
            "{} stops on the lost slot",
            p.name
        );
    }
    assert!(!slot.exists(&db), "no slot made silently");
    relays.args.push("--recover-slot".into());
    relays.kill_and_restart(0);
    relays.kill_and_restart(1);
    let committed = finished(&mut w, SHORT).await;
    assert_eq!(committed, SHORT.events);
    drained(&db, Some(&slot), SHORT.timeout()).await;
    drop(relays);
    let r = report(test, &db, &stream).await;
    assert_eq!(r.committed as u64, SHORT.events, "{r}");
    Mode::LogTailing.assert(&r);
}

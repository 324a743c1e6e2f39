//! The checker itself: each kind of fault counted, deleted rows held to the promise of marked
//! ones.

use super::*;

fn db_event(seq: i64, id: u128, aggregate: &str) -> DbEvent {
    DbEvent {
        seq: Some(seq),
        id: uuid::Uuid::from_u128(id),
        aggregate: aggregate.into(),
        in_outbox: true,
        in_business: true,
        marked: true,
    }
}

fn stream_message(n: u64, id: u128, aggregate: &str) -> StreamMessage {
    StreamMessage {
        stream_seq: n,
        msg_id: uuid::Uuid::from_u128(id).to_string(),
        aggregate: aggregate.into(),
        created_nanos: Some(0),
        stored_nanos: n as i128 * 1_000_000,
    }
}

#[test]
fn the_checker_counts_each_kind_of_fault() {
    let mut half = db_event(5, 5, "a/2");
    half.in_business = false;
    let events = [
        db_event(1, 1, "a/1"),
        db_event(2, 2, "a/1"),
        db_event(3, 3, "a/2"),
        db_event(4, 4, "a/1"),
        half,
    ];
    let messages = [
        stream_message(1, 2, "a/1"),
        stream_message(2, 1, "a/1"), // after seq 2 of its aggregate
        stream_message(3, 2, "a/1"), // a duplicate
        stream_message(4, 9, "a/1"), // never committed
        stream_message(5, 3, "a/2"),
    ];
    let r = checker::compare(&events, &messages);
    assert_eq!(
        (
            r.committed,
            r.torn,
            r.in_stream,
            r.missing,
            r.orphaned,
            r.duplicates,
            r.order_violations
        ),
        (4, 1, 5, 1, 1, 1, 1),
        "{r}"
    );
    assert_eq!(r.marked_not_in_stream, 2, "seq 4 and the torn seq 5: {r}");
    assert_eq!(r.max_wait, Duration::from_millis(5));
}

/// The record a deleting relay is checked against: a row deleted after its ack counts as
/// published; one deleted without a message in the stream is caught as marked but not in the
/// stream (and missing); a deletion that rolls back leaves no record.
#[tokio::test]
async fn the_checker_holds_deleted_rows_to_the_promise_of_marked_ones() {
    let (db, stream) = (fault_db(TestDb::new()), TestStream::new());
    seed_rows(&db, 4);
    // a relay's work, by hand: the first two rows published and deleted after their acks
    let js = stream.js().await;
    js.create_stream(jetstream::stream::Config {
        name: stream.name.clone(),
        subjects: vec![format!("{}.>", stream.prefix)],
        ..Default::default()
    })
    .await
    .expect("the stream");
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        seq: i64,
        #[diesel(sql_type = diesel::sql_types::Uuid)]
        id: uuid::Uuid,
        #[diesel(sql_type = diesel::sql_types::Text)]
        aggregate_id: String,
    }
    let mut conn = db.conn();
    let rows: Vec<Row> =
        diesel::sql_query("SELECT seq, id, aggregate_id FROM outbox ORDER BY seq LIMIT 2")
            .load(&mut conn)
            .expect("the oldest rows");
    for row in &rows {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", row.id.to_string().as_str());
        headers.insert("Outbox-Aggregate-Type", "account");
        headers.insert("Outbox-Aggregate-Id", row.aggregate_id.as_str());
        js.publish_with_headers(format!("{}.account.x", stream.prefix), headers, "{}".into())
            .await
            .expect("publish")
            .await
            .expect("ack");
    }
    let seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
    diesel::sql_query("DELETE FROM outbox WHERE seq = ANY($1)")
        .bind::<diesel::sql_types::Array<diesel::sql_types::BigInt>, _>(&seqs)
        .execute(&mut conn)
        .expect("delete the acked rows");
    // a deletion that rolls back is no deletion
    let _ = conn.transaction::<(), diesel::result::Error, _>(|c| {
        diesel::sql_query("DELETE FROM outbox").execute(c)?;
        Err(diesel::result::Error::RollbackTransaction)
    });
    let r = checker::check(&db, &stream).await;
    assert_eq!(
        (
            r.committed,
            r.outbox_rows,
            r.unpublished,
            r.missing,
            r.marked_not_in_stream
        ),
        (4, 4, 2, 2, 0),
        "{r}"
    );
    // a relay that deletes a row it never published breaks the promise, and the checker says so
    diesel::sql_query("DELETE FROM outbox WHERE seq = (SELECT max(seq) FROM outbox)")
        .execute(&mut conn)
        .expect("delete an unpublished row");
    let r = checker::check(&db, &stream).await;
    assert_eq!(
        (
            r.committed,
            r.unpublished,
            r.missing,
            r.marked_not_in_stream
        ),
        (4, 1, 2, 1),
        "{r}"
    );
    assert_eq!(db.scalar("SELECT count(*) FROM outbox"), 1);
}

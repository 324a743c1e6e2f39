//! Section 3: the write path, business transactions per second with and without the outbox.

use super::*;

impl Bench {
    /// Section 3.
    pub(super) async fn write_path(&mut self) -> Result<()> {
        use diesel::RunQueryDsl;
        let secs = self.args.seconds;
        println!(
            "\n## 3. write path: business transactions per second, 8 writers, {secs} s each\n"
        );
        let mut conn = PgConnection::establish(&self.db_url)?;
        diesel::sql_query("CREATE TABLE IF NOT EXISTS bench_orders (id bigserial PRIMARY KEY, customer text NOT NULL, note text NOT NULL)")
            .execute(&mut conn)?;
        let repeat = self.args.repeat.max(1);
        println!("Rounds of every kind in turn; median of {repeat} rounds, each ratio against the");
        println!("hand-written insert of its own round.\n");
        println!("| transaction | tx/s | ratio to hand-written insert |");
        println!("|---|---|---|");
        // per kind: tx/s of each round, ratio of each round
        let mut figures: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); 6];
        for _ in 0..repeat {
            let hand = self.writers(WriteKind::HandWritten, secs)?;
            let round = [
                self.writers(WriteKind::BusinessOnly, secs)?,
                hand,
                self.writers(WriteKind::RecordEvent, secs)?,
                self.writers(WriteKind::RecordEventNotifyOff, secs)?,
                self.writers_async(secs).await?,
                self.writers(WriteKind::RecordEventNotifyEveryCommit, secs)?,
            ];
            for (k, tps) in round.into_iter().enumerate() {
                figures[k].0.push(tps);
                figures[k].1.push(tps / hand);
            }
        }
        let names = [
            "business INSERT alone",
            "+ hand-written Diesel INSERT of the outbox row",
            "+ `record_event` (sync, default debounced NOTIFY)",
            "+ `record_event` (sync, NOTIFY off)",
            "+ `record_event` (async, default debounced NOTIFY)",
            "+ `record_event` with NOTIFY on every commit",
        ];
        for (name, (tps, ratios)) in names.iter().zip(figures.iter_mut()) {
            println!("| {name} | {:.0} | {:.2} |", median(tps), median(ratios));
        }
        Ok(())
    }

    pub(super) fn writers(&self, kind: WriteKind, secs: u64) -> Result<f64> {
        use diesel::RunQueryDsl;
        self.reset_outbox()?;
        let stop = Instant::now() + Duration::from_secs(secs);
        let outbox = Arc::new(match kind {
            WriteKind::RecordEventNotifyEveryCommit => {
                Outbox::default().notify(Notify::EveryTransaction)
            }
            WriteKind::RecordEventNotifyOff => Outbox::default().notify(Notify::Off),
            _ => Outbox::default(),
        });
        let handles: Vec<_> = (0..8)
            .map(|w| {
                let (url, outbox) = (self.db_url.clone(), outbox.clone());
                std::thread::spawn(move || -> Result<u64> {
                    let mut conn = PgConnection::establish(&url)?;
                    let mut n = 0u64;
                    while Instant::now() < stop {
                        let e = event(w * 1_000_000 + n as usize);
                        conn.transaction(|c| {
                            diesel::sql_query(
                                "INSERT INTO bench_orders (customer, note) VALUES ($1, $2)",
                            )
                            .bind::<diesel::sql_types::Text, _>(&e.customer)
                            .bind::<diesel::sql_types::Text, _>(&e.note)
                            .execute(c)?;
                            match kind {
                                WriteKind::BusinessOnly => {}
                                WriteKind::HandWritten => {
                                    use outbox_diesel::schema::outbox::dsl::*;
                                    diesel::insert_into(outbox)
                                        .values((
                                            id.eq(uuid::Uuid::now_v7()),
                                            aggregate_type.eq("order"),
                                            aggregate_id.eq(&e.order_id),
                                            event_type.eq("order.placed"),
                                            payload.eq(serde_json::to_value(&e).map_err(
                                                |err| {
                                                    diesel::result::Error::SerializationError(
                                                        Box::new(err),
                                                    )
                                                },
                                            )?),
                                        ))
                                        .execute(c)?;
                                }
                                WriteKind::RecordEvent
                                | WriteKind::RecordEventNotifyOff
                                | WriteKind::RecordEventNotifyEveryCommit => {
                                    c.record_event_in(&outbox, &e)?;
                                }
                            }
                            Ok::<_, diesel::result::Error>(())
                        })?;
                        n += 1;
                    }
                    Ok(n)
                })
            })
            .collect();
        let mut total = 0;
        for h in handles {
            total += h.join().map_err(|_| anyhow::anyhow!("writer panicked"))??;
        }
        Ok(total as f64 / secs as f64)
    }

    pub(super) async fn writers_async(&self, secs: u64) -> Result<f64> {
        use diesel_async::RunQueryDsl;
        self.reset_outbox()?;
        let stop = Instant::now() + Duration::from_secs(secs);
        let mut tasks = Vec::new();
        for w in 0..8usize {
            let url = self.db_url.clone();
            tasks.push(tokio::spawn(async move {
                let mut conn = AsyncPgConnection::establish(&url).await?;
                let mut n = 0u64;
                while Instant::now() < stop {
                    let e = event(w * 1_000_000 + n as usize);
                    conn.transaction(async |c| {
                        diesel::sql_query(
                            "INSERT INTO bench_orders (customer, note) VALUES ($1, $2)",
                        )
                        .bind::<diesel::sql_types::Text, _>(&e.customer)
                        .bind::<diesel::sql_types::Text, _>(&e.note)
                        .execute(c)
                        .await?;
                        c.record_event(&e).await?;
                        Ok::<_, diesel::result::Error>(())
                    })
                    .await?;
                    n += 1;
                }
                Ok::<u64, anyhow::Error>(n)
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += t.await??;
        }
        Ok(total as f64 / secs as f64)
    }
}

#[derive(Clone, Copy)]
pub(super) enum WriteKind {
    BusinessOnly,
    HandWritten,
    RecordEvent,
    RecordEventNotifyOff,
    RecordEventNotifyEveryCommit,
}

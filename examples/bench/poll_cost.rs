//! Section 4: the relays' fetch statements with rows kept, a backlog, rows held back and a
//! late pass; and cleanup's cost.

use super::*;

impl Bench {
    /// Section 4.
    pub(super) async fn poll_cost(&mut self) -> Result<()> {
        println!("\n## 4. poll cost: the relays' fetch queries, median of 200 runs\n");
        println!(
            "| table | unordered: ms to find the oldest row (LIMIT 1) | ratio to empty | unordered: ms per batch of 500 | ordered: ms per batch of 500 at its cursor (its session's CPU µs per row returned) |"
        );
        println!("|---|---|---|---|---|");
        self.reset_outbox()?;
        let empty = self.poll_time(1).await?;
        println!(
            "| empty | {empty:.3} | 1.00 | {:.3} | {:.3} |",
            self.poll_time(500).await?,
            self.batch_time(&outbox_diesel::relay::Cursor::start(), 500)
                .await?
        );
        let mut kept = 0;
        let mut cursor = outbox_diesel::relay::Cursor::start();
        for target in self.args.kept.clone() {
            if target <= kept {
                continue;
            }
            self.fill_published(target - kept)?;
            kept = target;
            // an ordered relay's cursor past every row kept
            cursor = self.cursor_now()?;
            let t = self.poll_time(1).await?;
            println!(
                "| {kept} published rows kept, none unpublished | {t:.3} | {:.2} | {:.3} | {:.3} |",
                t / empty,
                self.poll_time(500).await?,
                self.batch_time(&cursor, 500).await?
            );
        }
        self.fill(100_000, false)?;
        // a relay draining the backlog: its cursor's snapshot is that of its last batch, taken
        // after the backlog was written (the first batch after a restart reads the rows
        // written since the last recorded snapshot by transaction id once, on top)
        cursor.snap = self.cursor_now()?.snap;
        let backlog = self.poll_time(1).await?;
        println!(
            "| same + 100000 unpublished backlog | {backlog:.3} | {:.2} | {:.3} | {:.3} |",
            backlog / empty,
            self.poll_time(500).await?,
            self.batch_time(&cursor, 500).await?
        );
        // an ordered relay caught up: its cursor after the backlog, which it leaves in the
        // table unmarked (in `outbox_ready`), and the table analyzed since, as autovacuum does
        {
            use diesel::RunQueryDsl;
            let mut conn = PgConnection::establish(&self.db_url)?;
            diesel::sql_query("VACUUM ANALYZE outbox").execute(&mut conn)?;
        }
        println!(
            "| same, an ordered relay caught up (its cursor after the backlog, the table analyzed) | – | – | – | {:.3} |",
            self.batch_time(&self.cursor_now()?, 500).await?
        );
        let held = self.args.held_back;
        self.hold_back(held).await?;
        cursor.snap = self.cursor_now()?.snap;
        let t = self.poll_time(1).await?;
        println!(
            "| same + {held} rows of one aggregate held back behind its parked row | {t:.3} | {:.2} | {:.3} | {:.3} |",
            t / empty,
            self.poll_time(500).await?,
            self.batch_time(&cursor, 500).await?
        );
        let late = self.late_pass(100_000)?;
        let finding = outbox_diesel::relay::Cursor {
            late: None,
            ..late.clone()
        };
        println!(
            "| same + a late pass over 100000 rows of one transaction, the batch that finds them (and reads the first part) | – | – | – | {:.3} |",
            self.batch_time(&finding, 500).await?
        );
        println!(
            "| same + a late pass over 100000 rows of one transaction, its first part read | – | – | – | {:.3} |",
            self.batch_time(&late, 500).await?
        );
        Ok(())
    }

    /// A cursor in a late pass: `n` rows of one transaction that committed after an ordered
    /// relay had read a later row (so they are late for its cursor), the pass's first part of
    /// 500 read.
    pub(super) fn late_pass(&self, n: usize) -> Result<outbox_diesel::relay::Cursor> {
        use diesel::RunQueryDsl;
        #[derive(QueryableByName)]
        struct Seq {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            seq: i64,
        }
        let mut bulk = PgConnection::establish(&self.db_url)?;
        diesel::sql_query("SET synchronous_commit = off").execute(&mut bulk)?;
        diesel::sql_query("BEGIN").execute(&mut bulk)?;
        let first: Seq = diesel::sql_query(format!(
            "WITH ins AS (INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT gen_random_uuid(), 'bulk', 'b-' || (i % 100), 'bulk.loaded', \
             jsonb_build_object('i', i, 'note', repeat('x', 230)) FROM generate_series(1, {n}) i \
             RETURNING seq) SELECT min(seq) AS seq FROM ins"
        ))
        .get_result(&mut bulk)?;
        let mut later = PgConnection::establish(&self.db_url)?;
        diesel::sql_query(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES (gen_random_uuid(), 'order', 'later', 'order.placed', '{}')",
        )
        .execute(&mut later)?;
        // the relay read up to the later row while the transaction was open
        let mut cursor = self.cursor_now()?;
        diesel::sql_query("COMMIT").execute(&mut bulk)?;
        diesel::sql_query("VACUUM ANALYZE outbox").execute(&mut later)?;
        cursor.late = Some(outbox_diesel::relay::LatePass {
            after_seq: first.seq + 499,
            snap: self.cursor_now()?.snap,
        });
        Ok(cursor)
    }

    /// A cursor past every row in the table, as an ordered relay leaves it after reading them.
    pub(super) fn cursor_now(&self) -> Result<outbox_diesel::relay::Cursor> {
        use diesel::RunQueryDsl;
        #[derive(diesel::QueryableByName)]
        struct Now {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            upto_seq: i64,
            #[diesel(sql_type = diesel::sql_types::Text)]
            snap: String,
        }
        let mut conn = PgConnection::establish(&self.db_url)?;
        let now: Now = diesel::sql_query(
            "SELECT COALESCE(max(seq), 0) AS upto_seq, pg_current_snapshot()::text AS snap FROM outbox",
        )
        .get_result(&mut conn)?;
        Ok(outbox_diesel::relay::Cursor::at(now.upto_seq, now.snap))
    }

    /// The median of 200 runs of the ordered relay's batch at `cursor`, in ms (after 20 runs
    /// that set aside what a parked row holds back), and its session's CPU per row returned
    /// over those 200 runs.
    pub(super) async fn batch_time(
        &self,
        cursor: &outbox_diesel::relay::Cursor,
        limit: i64,
    ) -> Result<BatchCost> {
        let mut conn = AsyncPgConnection::establish(&self.db_url).await?;
        outbox_diesel::relay::prepare_session(&mut conn).await?;
        let backend = outbox_diesel::relay::backend_pid(&mut conn).await? as u32;
        let table = outbox_diesel::OutboxTable::DEFAULT;
        let part = outbox_diesel::relay::Partition::ALL;
        let mut times = Vec::with_capacity(200);
        let (mut rows, mut cpu_before) = (0, 0.0);
        for i in 0..220 {
            if i == 20 {
                cpu_before = process_cpu_secs(backend);
            }
            let start = Instant::now();
            let batch = outbox_diesel::relay::fetch_batch(
                &mut conn,
                &table,
                part,
                cursor,
                &[],
                limit,
                8 << 20,
            )
            .await?;
            if i >= 20 {
                times.push(start.elapsed().as_secs_f64() * 1000.0);
                rows += batch.rows.len();
            }
        }
        let cpu = process_cpu_secs(backend) - cpu_before;
        Ok(BatchCost {
            ms: median(&mut times),
            us_per_row: (rows > 0).then(|| cpu * 1e6 / rows as f64),
        })
    }

    /// Section 6: what deleting kept rows costs PostgreSQL, for rows marked `published_at`
    /// (unordered, and the ordered relay before snapshot batches) and for rows an ordered
    /// relay's cursor covered, each published an hour ago: the relay's own cleanup
    /// (`outbox_nats::cleanup::sweep`, batches of 5,000) and a `VACUUM` after it.
    pub(super) async fn cleanup_cost(&mut self) -> Result<()> {
        use diesel::RunQueryDsl;
        let n = self.args.events;
        println!("\n## 6. cleanup of {n} kept rows: PostgreSQL CPU per row removed\n");
        println!(
            "| rows published by | deleted in | delete: PostgreSQL CPU µs/row | delete + VACUUM: µs/row |"
        );
        println!("|---|---|---|---|");
        for covered in [false, true] {
            self.reset_outbox()?;
            self.fill(n, false)?;
            let mut conn = PgConnection::establish(&self.db_url)?;
            if covered {
                diesel::sql_query(
                    "INSERT INTO outbox_progress (partitions, partition, upto_seq, snap, published_at) \
                     SELECT 1, 0, max(seq), pg_current_snapshot(), now() - interval '1 hour' FROM outbox",
                )
                .execute(&mut conn)?;
            } else {
                diesel::sql_query("UPDATE outbox SET published_at = now() - interval '1 hour'")
                    .execute(&mut conn)?;
            }
            let table = outbox_diesel::OutboxTable::DEFAULT;
            let (deleted, took, delete, total) = self.measured_sweep(&mut conn, &table, n).await?;
            if deleted as usize != n {
                bail!("cleanup removed {deleted} rows of {n}");
            }
            let by = if covered {
                "the ordered relay (a cursor covered them)"
            } else {
                "a mark (`published_at` set)"
            };
            println!("| {by} | {took:.2?} | {delete:.1} | {total:.1} |");
        }
        // a rotated table: the same rows in three partitions of a ring of four, each emptied
        // with one TRUNCATE; a tenth of them as well, for a cost that does not follow the rows
        for rows in [n, n / 10] {
            let (took, delete, total) = self.rotated_cleanup(rows).await?;
            println!(
                "| the ordered relay, a rotated table (`partition_table`): {rows} rows in 3 partitions emptied | {took:.2?} | {delete:.2} ({:.1} ms in all) | {total:.2} |",
                delete * rows as f64 / 1000.0
            );
        }
        Ok(())
    }

    /// `rows` rows covered by a cursor recorded an hour ago, in the first three partitions of
    /// a ring of four (`outbox_diesel::partition_table`, blocks of a third of them), the
    /// fourth being filled: the relay's cleanup, timed, then a `VACUUM`. Returns the time and
    /// PostgreSQL's CPU per row removed without and with the `VACUUM`.
    pub(super) async fn rotated_cleanup(&self, rows: usize) -> Result<(Duration, f64, f64)> {
        use diesel::RunQueryDsl;
        let table = outbox_diesel::OutboxTable::new("bench_ring")?;
        let block = rows.div_ceil(3).max(1000) as i64;
        let mut conn = PgConnection::establish(&self.db_url)?;
        diesel::sql_query("DROP TABLE IF EXISTS bench_ring, bench_ring_progress CASCADE")
            .execute(&mut conn)?;
        outbox_diesel::partition_table(
            &mut conn,
            &table,
            outbox_diesel::Rotation::default().block_rows(block),
        )?;
        diesel::sql_query("SET synchronous_commit = off").execute(&mut conn)?;
        diesel::sql_query(format!(
            "INSERT INTO bench_ring (id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT gen_random_uuid(), 'order', 'order-' || (i % 1000), 'order.placed', \
             jsonb_build_object('order_id', 'order-' || (i % 1000), 'customer', 'customer-' || i, 'note', repeat('x', 230)) \
             FROM generate_series(1, {rows}) i"
        ))
        .execute(&mut conn)?;
        // the next seq goes to the fourth partition, the one being filled
        diesel::sql_query(format!(
            "SELECT setval(pg_get_serial_sequence('bench_ring', 'seq'), {})",
            3 * block
        ))
        .execute(&mut conn)?;
        diesel::sql_query(
            "INSERT INTO bench_ring_progress (partitions, partition, upto_seq, snap, published_at) \
             SELECT 1, 0, max(seq), pg_current_snapshot(), now() - interval '1 hour' FROM bench_ring",
        )
        .execute(&mut conn)?;
        let (_, took, delete, total) = self.measured_sweep(&mut conn, &table, rows).await?;
        #[derive(QueryableByName)]
        struct Left {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let left: Left =
            diesel::sql_query("SELECT count(*) AS n FROM bench_ring").get_result(&mut conn)?;
        diesel::sql_query("DROP TABLE bench_ring, bench_ring_progress CASCADE")
            .execute(&mut conn)?;
        if left.n != 0 {
            bail!(
                "cleanup of the rotated table left {} rows of {rows}",
                left.n
            );
        }
        Ok((took, delete, total))
    }

    /// `VACUUM ANALYZE` of `table`, then the relay's cleanup of it (retention 60 s, batches
    /// of 5,000) and a `VACUUM`: the rows it deleted one by one, its time, and PostgreSQL's
    /// CPU per row of `rows` without and with the `VACUUM`.
    pub(super) async fn measured_sweep(
        &self,
        conn: &mut PgConnection,
        table: &outbox_diesel::OutboxTable,
        rows: usize,
    ) -> Result<(u64, Duration, f64, f64)> {
        use diesel::RunQueryDsl;
        let t = table.quoted();
        diesel::sql_query(format!("VACUUM ANALYZE {t}")).execute(conn)?;
        let mut aconn = AsyncPgConnection::establish(&self.db_url).await?;
        let before = cpu_snapshot();
        let started = Instant::now();
        let deleted = outbox_nats::cleanup::sweep(
            &mut aconn,
            table,
            None,
            Duration::from_secs(60),
            5_000,
            &CancellationToken::new(),
        )
        .await?;
        let took = started.elapsed();
        let deleting = cpu_snapshot();
        diesel::sql_query(format!("VACUUM {t}")).execute(conn)?;
        let after = cpu_snapshot();
        Ok((
            deleted,
            took,
            CpuUse::between(&before, &deleting, rows, &[]).postgres,
            CpuUse::between(&before, &after, rows, &[]).postgres,
        ))
    }

    /// A hot aggregate's row parked with `n` later rows of it recorded, held back the way the
    /// relay holds them (`outbox_diesel::relay::hold_back`), then vacuumed.
    pub(super) async fn hold_back(&self, n: usize) -> Result<()> {
        use diesel::RunQueryDsl;
        let mut conn = PgConnection::establish(&self.db_url)?;
        diesel::sql_query("SET synchronous_commit = off").execute(&mut conn)?;
        diesel::sql_query(format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, attempts, last_error, parked_at) \
             SELECT gen_random_uuid(), 'order', 'hot', 'order.placed', \
             jsonb_build_object('i', i, 'note', repeat('x', 230)), \
             CASE WHEN i = 0 THEN 5 ELSE 0 END, CASE WHEN i = 0 THEN 'rejected' END, \
             CASE WHEN i = 0 THEN now() END FROM generate_series(0, {n}) i"
        ))
        .execute(&mut conn)?;
        #[derive(QueryableByName)]
        struct Seq {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            seq: i64,
        }
        let seqs: Vec<i64> = diesel::sql_query(
            "SELECT seq FROM outbox WHERE aggregate_id = 'hot' AND parked_at IS NULL ORDER BY seq",
        )
        .load::<Seq>(&mut conn)?
        .into_iter()
        .map(|s| s.seq)
        .collect();
        let mut aconn = AsyncPgConnection::establish(&self.db_url).await?;
        let table = outbox_diesel::OutboxTable::DEFAULT;
        let mut held = 0;
        for chunk in seqs.chunks(50_000) {
            held += outbox_diesel::relay::hold_back(&mut aconn, &table, chunk).await?;
        }
        if held != n {
            bail!("held back {held} rows of {n}");
        }
        diesel::sql_query("VACUUM ANALYZE outbox").execute(&mut conn)?;
        Ok(())
    }

    /// Adds `n` published rows the way a relay leaves them: inserted unpublished (so they
    /// entered the partial index), then marked, then vacuumed as autovacuum would.
    pub(super) fn fill_published(&self, n: usize) -> Result<()> {
        use diesel::RunQueryDsl;
        let mut conn = PgConnection::establish(&self.db_url)?;
        let chunk = 500_000;
        let mut done = 0;
        while done < n {
            let m = chunk.min(n - done);
            self.fill(m, false)?;
            diesel::sql_query(
                "UPDATE outbox SET published_at = now() - interval '1 hour' WHERE published_at IS NULL",
            )
            .execute(&mut conn)?;
            diesel::sql_query("VACUUM outbox").execute(&mut conn)?;
            done += m;
        }
        diesel::sql_query("VACUUM ANALYZE outbox").execute(&mut conn)?;
        Ok(())
    }

    /// The median of 200 runs of the fetch, in ms.
    pub(super) async fn poll_time(&self, limit: i64) -> Result<f64> {
        let mut conn = AsyncPgConnection::establish(&self.db_url).await?;
        outbox_diesel::relay::prepare_session(&mut conn).await?;
        let table = outbox_diesel::OutboxTable::DEFAULT;
        let part = outbox_diesel::relay::Partition::ALL;
        for _ in 0..20 {
            outbox_diesel::relay::fetch_unpublished(&mut conn, &table, part, &[], limit).await?;
        }
        let mut times = Vec::with_capacity(200);
        for _ in 0..200 {
            let start = Instant::now();
            outbox_diesel::relay::fetch_unpublished(&mut conn, &table, part, &[], limit).await?;
            times.push(start.elapsed().as_secs_f64() * 1000.0);
        }
        Ok(median(&mut times))
    }
}

/// A batch's median time and its session's CPU per row returned (none when it returned no
/// row), as section 4 prints them: `2.104 (3.9)`.
pub(super) struct BatchCost {
    ms: f64,
    us_per_row: Option<f64>,
}

impl std::fmt::Display for BatchCost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.us_per_row {
            Some(us) => write!(f, "{:.3} ({us:.1})", self.ms),
            None => write!(f, "{:.3}", self.ms),
        }
    }
}

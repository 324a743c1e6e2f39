//! Section 1: the relay's throughput against the bare publishers, per mode, partition count
//! and relay count, with the CPU each process spent per event.

use super::*;

impl Bench {
    /// Section 1.
    pub(super) async fn throughput(&mut self) -> Result<()> {
        let n = self.args.events;
        let repeat = self.args.repeat.max(1);
        println!("\n## 1. relay throughput ({n} events of ~300 B, file storage, dedup on)\n");
        println!(
            "Each run follows its own baselines, the same messages with 512 acks in flight: a bare \
             async-nats publisher (JetStream's publish API, a future per ack), and a lean one (core \
             NATS publishes with a numbered reply subject under one inbox subscription, as the relay \
             publishes); median of {repeat}. The steady rate is the relays' between the moments the \
             stream held a tenth and nine tenths of the backlog: without their start (the \
             process, its sessions, the partitions' shares settling), which the whole drain's \
             rate counts. The last column is the baseline's CPU per event \
             outside PostgreSQL (nats-server + publisher) over the relay's (nats-server + relay): \
             the ratio to expect where the database has cores of its own.\n"
        );
        println!(
            "| run | events/s | baseline events/s | ratio to baseline | lean baseline events/s | ratio to lean baseline | steady events/s | steady ratio to baseline | steady CPU µs per event: PostgreSQL / nats-server / relay | CPU µs per event: PostgreSQL / nats-server / relay | baseline: nats-server / publisher | lean baseline: nats-server / publisher | CPU ratio outside PostgreSQL |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        let run = |name, mode, partitions, workers, relays, delete| Run {
            name,
            mode,
            partitions,
            workers,
            relays,
            delete,
            ring: None,
            cleanup: false,
            indexed: false,
            skewed: false,
        };
        let runs = [
            run(
                "ordered, 1 partition, 1 relay",
                ModeKind::Ordered,
                1,
                1,
                1,
                false,
            ),
            Run {
                ring: Some(1_000_000),
                ..run(
                    "ordered, 1 partition, 1 relay, rotated table (4 partitions)",
                    ModeKind::Ordered,
                    1,
                    1,
                    1,
                    false,
                )
            },
            Run {
                cleanup: true,
                ..run(
                    "ordered, 1 partition, 1 relay, cleanup to the end (--retention 0s)",
                    ModeKind::Ordered,
                    1,
                    1,
                    1,
                    false,
                )
            },
            Run {
                cleanup: true,
                // the backlog in 3.5 blocks: three partitions go by TRUNCATE
                ring: Some((n as i64 * 2 / 7).max(1000)),
                ..run(
                    "ordered, 1 partition, 1 relay, cleanup to the end (--retention 0s), rotated table (4 partitions, blocks of 2/7 of the backlog)",
                    ModeKind::Ordered,
                    1,
                    1,
                    1,
                    false,
                )
            },
            run(
                "ordered, 1 partition, 1 relay, --delete-published",
                ModeKind::Ordered,
                1,
                1,
                1,
                true,
            ),
            run(
                "ordered, 4 partitions, 1 relay",
                ModeKind::Ordered,
                4,
                1,
                1,
                false,
            ),
            run(
                "ordered, 4 partitions, 2 relays",
                ModeKind::Ordered,
                4,
                1,
                2,
                false,
            ),
            Run {
                indexed: true,
                ..run(
                    "ordered, 4 partitions, 2 relays, partition index",
                    ModeKind::Ordered,
                    4,
                    1,
                    2,
                    false,
                )
            },
            run(
                "ordered, 4 partitions, 2 relays, --delete-published",
                ModeKind::Ordered,
                4,
                1,
                2,
                true,
            ),
            Run {
                indexed: true,
                ..run(
                    "ordered, 4 partitions, 2 relays, --delete-published, partition index",
                    ModeKind::Ordered,
                    4,
                    1,
                    2,
                    true,
                )
            },
            run(
                "ordered, 8 partitions, 4 relays",
                ModeKind::Ordered,
                8,
                1,
                4,
                false,
            ),
            Run {
                indexed: true,
                ..run(
                    "ordered, 8 partitions, 4 relays, partition index",
                    ModeKind::Ordered,
                    8,
                    1,
                    4,
                    false,
                )
            },
            Run {
                skewed: true,
                ..run(
                    "ordered, 8 partitions, 4 relays, one busy partition (9 events in 10)",
                    ModeKind::Ordered,
                    8,
                    1,
                    4,
                    false,
                )
            },
            Run {
                indexed: true,
                skewed: true,
                ..run(
                    "ordered, 8 partitions, 4 relays, partition index, one busy partition (9 events in 10)",
                    ModeKind::Ordered,
                    8,
                    1,
                    4,
                    false,
                )
            },
            run(
                "unordered, 4 workers, 1 relay",
                ModeKind::Unordered,
                1,
                4,
                1,
                false,
            ),
            run(
                "log-tailing, 1 relay (transactions of 100 events)",
                ModeKind::LogTailing,
                1,
                1,
                1,
                false,
            ),
        ];
        if let Some(unknown) = self
            .args
            .run
            .iter()
            .find(|f| !runs.iter().any(|r| r.name == f.as_str()))
        {
            let names: Vec<&str> = runs.iter().map(|r| r.name).collect();
            anyhow::bail!("--run {unknown:?} names no run; the runs are: {names:#?}");
        }
        let logical = self.wal_level()? == "logical";
        for r in runs {
            let picked = (self.args.runs.is_empty() && self.args.run.is_empty())
                || self.args.runs.iter().any(|f| r.name.contains(f.as_str()))
                || self.args.run.iter().any(|f| r.name == f.as_str());
            if !picked {
                continue;
            }
            if r.mode == ModeKind::LogTailing && !logical {
                println!(
                    "| {} | skipped: `wal_level` is not `logical` (`ALTER SYSTEM SET wal_level = logical` and restart PostgreSQL) | | | | | | | | | | | |",
                    r.name
                );
                continue;
            }
            let ring = r.ring.or(self.args.rotated.then_some(1_000_000));
            let mut rates = Vec::new();
            let mut baselines = Vec::new();
            let mut ratios = Vec::new();
            let mut cpu = Vec::new();
            let mut base_cpu = Vec::new();
            let (mut leans, mut lean_ratios, mut lean_cpu) = (Vec::new(), Vec::new(), Vec::new());
            let (mut steadies, mut steady_ratios, mut steady_cpu) =
                (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..repeat {
                // a ring made anew each time, so that the backlog starts at its first block
                self.rotate_outbox(ring)?;
                self.partition_index(r.indexed.then_some(r.partitions))?;
                let (baseline, b) = self.raw_publish(n).await?;
                let (lean, l) = self.raw_publish_lean(n).await?;
                let (rate, steady, c) = self.relay_run(n, &r).await?;
                steadies.push(steady.rate);
                steady_ratios.push(steady.rate / baseline);
                steady_cpu.push(steady.cpu);
                leans.push(lean);
                lean_ratios.push(rate / lean);
                lean_cpu.push(l);
                rates.push(rate);
                baselines.push(baseline);
                ratios.push(rate / baseline);
                cpu.push(c);
                base_cpu.push(b);
            }
            let (c, b) = (CpuUse::median(&cpu), CpuUse::median(&base_cpu));
            let l = CpuUse::median(&lean_cpu);
            let s = CpuUse::median(&steady_cpu);
            println!(
                "| {} | {:.0} | {:.0} | {:.2} | {:.0} | {:.2} | {:.0} | {:.2} | {:.1} / {:.1} / {:.1} | {:.1} / {:.1} / {:.1} | {:.1} / {:.1} | {:.1} / {:.1} | {:.2} |",
                r.name,
                median(&mut rates),
                median(&mut baselines),
                median(&mut ratios),
                median(&mut leans),
                median(&mut lean_ratios),
                median(&mut steadies),
                median(&mut steady_ratios),
                s.postgres,
                s.nats,
                s.own,
                c.postgres,
                c.nats,
                c.own,
                b.nats,
                b.own,
                l.nats,
                l.own,
                (b.nats + b.own) / (c.nats + c.own).max(f64::EPSILON)
            );
        }
        self.rotate_outbox(self.args.rotated.then_some(1_000_000))?;
        self.partition_index(None)?;
        Ok(())
    }

    /// Drops the outbox's partition indexes, and makes that of `partitions` partitions, if any
    /// (`outbox_diesel::create_partition_index`, as `outbox-relay index` does).
    pub(super) fn partition_index(&self, partitions: Option<u32>) -> Result<()> {
        use diesel::RunQueryDsl;
        let mut conn = PgConnection::establish(&self.db_url)?;
        diesel::sql_query(
            "DO $$ DECLARE i text; BEGIN FOR i IN SELECT indexrelid::regclass::text \
             FROM pg_index WHERE indrelid = 'outbox'::regclass \
             AND indexrelid::regclass::text LIKE 'outbox\\_ready\\_p%' \
             LOOP EXECUTE 'DROP INDEX ' || i; END LOOP; END $$",
        )
        .execute(&mut conn)?;
        if let Some(n) = partitions {
            outbox_diesel::create_partition_index(
                &mut conn,
                &outbox_diesel::OutboxTable::DEFAULT,
                n,
            )?;
        }
        Ok(())
    }

    /// Makes `outbox` anew as a ring of four partitions of `ring` rows a block
    /// (`outbox_diesel::partition_table`), or, with `None`, a plain table again (made anew,
    /// empty, when it was a ring).
    pub(super) fn rotate_outbox(&self, ring: Option<i64>) -> Result<()> {
        use diesel::RunQueryDsl;
        let mut conn = PgConnection::establish(&self.db_url)?;
        let table = outbox_diesel::OutboxTable::DEFAULT;
        #[derive(QueryableByName)]
        struct Partitioned {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            p: bool,
        }
        let found: Partitioned = diesel::sql_query(
            "SELECT EXISTS (SELECT 1 FROM pg_partitioned_table \
             WHERE partrelid = to_regclass('outbox')) AS p",
        )
        .get_result(&mut conn)?;
        if found.p || ring.is_some() {
            diesel::sql_query("DROP TABLE outbox, outbox_progress CASCADE").execute(&mut conn)?;
            outbox_diesel::create_table(&mut conn, &table)?;
            // the dropped table left log tailing's publication
            diesel::sql_query("DROP PUBLICATION IF EXISTS outbox_pub").execute(&mut conn)?;
        }
        if let Some(block) = ring {
            outbox_diesel::partition_table(
                &mut conn,
                &table,
                outbox_diesel::Rotation::default().block_rows(block),
            )?;
        }
        Ok(())
    }

    pub(super) async fn raw_publish(&mut self, n: usize) -> Result<(f64, CpuUse)> {
        let (name, prefix) = ("BENCH_RAW", "benchraw");
        self.stream(name, prefix).await?;
        let payload = bytes::Bytes::from(serde_json::to_vec(&event(0))?);
        let cpu_before = cpu_snapshot();
        let start = Instant::now();
        let mut in_flight = FuturesUnordered::new();
        for i in 0..n {
            if in_flight.len() >= 512
                && let Some(r) = in_flight.next().await
            {
                r?;
            }
            let (subject, h) = raw_message(prefix, i);
            let ack = self
                .js
                .publish_with_headers(subject, h, payload.clone())
                .await?;
            in_flight.push(ack.into_future());
        }
        while let Some(r) = in_flight.next().await {
            r?;
        }
        let rate = n as f64 / start.elapsed().as_secs_f64();
        Ok((
            rate,
            CpuUse::between(&cpu_before, &cpu_snapshot(), n, &[std::process::id()]),
        ))
    }

    /// The same messages as [`Bench::raw_publish`], published with core NATS and a reply
    /// subject under one wildcard inbox subscription, each ack matched by its reply subject:
    /// no future, channel or timer per message.
    pub(super) async fn raw_publish_lean(&mut self, n: usize) -> Result<(f64, CpuUse)> {
        #[derive(serde::Deserialize)]
        struct Ack {
            seq: Option<u64>,
        }
        let (name, prefix) = ("BENCH_RAW", "benchraw");
        self.stream(name, prefix).await?;
        let payload = bytes::Bytes::from(serde_json::to_vec(&event(0))?);
        let inbox = self.nats.new_inbox();
        let mut acks = self.nats.subscribe(format!("{inbox}.*")).await?;
        let cpu_before = cpu_snapshot();
        let start = Instant::now();
        let mut in_flight = 0usize;
        let take_ack = async |acks: &mut async_nats::Subscriber| -> Result<()> {
            let m = acks.next().await.context("the ack subscription ended")?;
            let ack: Ack = serde_json::from_slice(&m.payload)?;
            ack.seq.context("a publish was refused")?;
            Ok(())
        };
        for i in 0..n {
            if in_flight >= 512 {
                take_ack(&mut acks).await?;
                in_flight -= 1;
            }
            let (subject, h) = raw_message(prefix, i);
            self.nats
                .publish_with_reply_and_headers(subject, format!("{inbox}.{i}"), h, payload.clone())
                .await?;
            in_flight += 1;
        }
        while in_flight > 0 {
            take_ack(&mut acks).await?;
            in_flight -= 1;
        }
        let rate = n as f64 / start.elapsed().as_secs_f64();
        Ok((
            rate,
            CpuUse::between(&cpu_before, &cpu_snapshot(), n, &[std::process::id()]),
        ))
    }

    /// The relays' rate over the whole drain, from their start, with the CPU each process spent
    /// per event, and the same between a tenth and nine tenths of it (its steady state).
    pub(super) async fn relay_run(&mut self, n: usize, run: &Run) -> Result<(f64, Steady, CpuUse)> {
        let (mode, partitions, workers, relays) =
            (run.mode, run.partitions, run.workers, run.relays);
        let (delete_published, cleanup) = (run.delete, run.cleanup);
        self.reset_outbox()?;
        let tailing = mode == ModeKind::LogTailing;
        let slot = format!("{}_slot", self.db_name);
        if tailing {
            // the slot sees only what commits after its creation: make it before the backlog
            self.create_slot(&slot)?;
            self.fill_rows(n, 100, false)?;
        } else if run.skewed {
            self.fill_skewed(n)?;
        } else {
            self.fill(n, false)?;
        }
        let name = format!(
            "BENCH_{}_{partitions}_{workers}_{relays}_{}",
            mode.to_string().to_uppercase(),
            u8::from(delete_published)
        );
        let prefix = name.to_lowercase().replace('_', "");
        self.stream(&name, &prefix).await?;
        let mut args = vec![
            "--mode".to_owned(),
            mode.to_string(),
            "--partitions".to_owned(),
            partitions.to_string(),
            "--workers".to_owned(),
            workers.to_string(),
            "--batch-size".to_owned(),
            self.args.batch_size.to_string(),
        ];
        if delete_published {
            args.push("--delete-published".to_owned());
        }
        if cleanup {
            args.extend(["--retention", "0s", "--cleanup-interval", "1s"].map(String::from));
        }
        if tailing {
            args.extend(["--slot".to_owned(), slot.clone()]);
        }
        let cpu_before = cpu_snapshot();
        let start = Instant::now();
        let children = (0..relays)
            .map(|_| self.spawn_relay(&name, &prefix, &args))
            .collect::<Result<Vec<_>>>()?;
        // when the stream first held a tenth of the backlog and nine tenths: the rate between
        // them leaves out the relays' start (the process, its sessions, the partitions' shares)
        let (mut tenth, mut nine_tenths) = (None, None);
        loop {
            let stored = self.stored(&name).await?;
            if tenth.is_none() && stored * 10 >= n as u64 {
                tenth = Some((Instant::now(), stored, cpu_snapshot()));
            }
            if nine_tenths.is_none() && stored * 10 >= n as u64 * 9 {
                nine_tenths = Some((Instant::now(), stored, cpu_snapshot()));
            }
            if stored >= n as u64 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            if start.elapsed() > Duration::from_secs(600) {
                bail!("the relay did not drain {n} events in 10 minutes");
            }
        }
        let rate = n as f64 / start.elapsed().as_secs_f64();
        let pids: Vec<u32> = children.iter().map(RelayProcess::id).collect();
        let steady = match (tenth, nine_tenths) {
            (Some((t1, n1, c1)), Some((t9, n9, c9))) if t9 > t1 && n9 > n1 => Steady {
                rate: (n9 - n1) as f64 / (t9 - t1).as_secs_f64(),
                cpu: CpuUse::between(&c1, &c9, (n9 - n1) as usize, &pids),
            },
            _ => Steady {
                rate,
                cpu: CpuUse::default(),
            },
        };
        if cleanup {
            // the cleanup of what was published counts in the run's CPU
            let drained = Instant::now();
            while self.rows_left()? > 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                if drained.elapsed() > Duration::from_secs(120) {
                    bail!("cleanup did not empty the outbox in 2 minutes");
                }
            }
        }
        // before the relays exit and take their figures (and their backends') with them
        let cpu = CpuUse::between(&cpu_before, &cpu_snapshot(), n, &pids);
        drop(children);
        if tailing {
            self.drop_slot(&slot)?;
        }
        Ok((rate, steady, cpu))
    }

    /// Rows in the outbox.
    pub(super) fn rows_left(&self) -> Result<i64> {
        use diesel::RunQueryDsl;
        #[derive(QueryableByName)]
        struct Left {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let mut conn = PgConnection::establish(&self.db_url)?;
        Ok(diesel::sql_query("SELECT count(*) AS n FROM outbox")
            .get_result::<Left>(&mut conn)?
            .n)
    }
}

/// A drain's steady state: its rate and CPU per event between a tenth and nine tenths of it.
pub(super) struct Steady {
    rate: f64,
    cpu: CpuUse,
}

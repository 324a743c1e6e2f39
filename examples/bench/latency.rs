//! Section 2: commit-to-ack latency at a steady rate of committed transactions.

use super::*;

impl Bench {
    /// Section 2.
    pub(super) async fn latency(&mut self) -> Result<()> {
        println!(
            "\n## 2. commit-to-ack latency (steady rate of committed transactions, one event each)\n"
        );
        println!(
            "PostgreSQL's CPU per event counts the writers' inserts and commits too: the same in every row of a rate, so the difference between rows is the relay's reads.\n"
        );
        println!("| rate | wake-up | p50 ms | p99 ms | max ms | PostgreSQL CPU µs per event |");
        println!("|---|---|---|---|---|---|");
        let logical = self.wal_level()? == "logical";
        let rates = self.args.rates.clone();
        for rate in rates {
            for wake in [
                Wake::Notify,
                Wake::NotifyNoLinger,
                Wake::Poll,
                Wake::Tailing,
            ] {
                let how = match wake {
                    Wake::Notify => "LISTEN/NOTIFY (debounced 10 ms) + 100 ms poll, 10 ms linger",
                    Wake::NotifyNoLinger => {
                        "LISTEN/NOTIFY (debounced 10 ms) + 100 ms poll, --linger 0"
                    }
                    Wake::Poll => "poll only, 100 ms, 10 ms linger",
                    Wake::Tailing => "log tailing (the replication stream pushes each commit)",
                };
                if !self.args.wakes.is_empty() && !self.args.wakes.contains(&wake) {
                    continue;
                }
                if wake == Wake::Tailing && !logical {
                    println!("| {rate}/s | {how} | skipped: `wal_level` is not `logical` | | | |");
                    continue;
                }
                let (p50, p99, max, pg) = self.latency_run(rate, wake).await?;
                println!("| {rate}/s | {how} | {p50:.1} | {p99:.1} | {max:.1} | {pg:.1} |");
            }
        }
        Ok(())
    }

    pub(super) async fn latency_run(
        &mut self,
        rate: u32,
        wake: Wake,
    ) -> Result<(f64, f64, f64, f64)> {
        self.reset_outbox()?;
        let listen = matches!(wake, Wake::Notify | Wake::NotifyNoLinger);
        let tag = format!("{wake:?}").to_lowercase();
        let name = format!("BENCH_LAT_{rate}_{tag}");
        let prefix = format!("benchlat{rate}{tag}");
        self.stream(&name, &prefix).await?;
        let slot = format!("{}_slot", self.db_name);
        if wake == Wake::Tailing {
            self.create_slot(&slot)?;
        }
        let mut sub = self.nats.subscribe(format!("{prefix}.>")).await?;
        let shutdown = CancellationToken::new();
        let nats = async_nats::connect(&self.args.nats_url).await?;
        let config = RelayConfig::new(self.db_url.clone())
            .stream(name.clone())
            .subject_prefix(prefix.clone())
            .listen(listen)
            .batch_size(self.args.batch_size);
        let config = if wake == Wake::NotifyNoLinger {
            config.linger(Duration::ZERO)
        } else {
            config
        };
        let config = if wake == Wake::Tailing {
            config.mode(LogTailing::default().slot(slot.clone()))
        } else {
            config
        };
        if self.args.latency_kept > 0 && wake != Wake::Tailing {
            use diesel::RunQueryDsl;
            self.fill(self.args.latency_kept, false)?;
            let mut conn = PgConnection::establish(&self.db_url)?;
            diesel::sql_query(
                "INSERT INTO outbox_progress (partitions, partition, upto_seq, snap) \
                 SELECT 1, 0, max(seq), pg_current_snapshot() FROM outbox",
            )
            .execute(&mut conn)?;
            diesel::sql_query("VACUUM ANALYZE outbox").execute(&mut conn)?;
        }
        let relay = tokio::spawn(Relay::new(config, nats).run(shutdown.clone()));
        tokio::time::sleep(Duration::from_millis(500)).await;
        let cpu_before = cpu_snapshot();
        let duration = Duration::from_secs(self.args.seconds.max(3));
        let total = (rate as u64 * duration.as_secs()) as usize;
        let started = Instant::now();
        // writers: 4 threads sharing the rate
        let writers: Vec<_> = (0..4)
            .map(|w| {
                let url = self.db_url.clone();
                let outbox = Outbox::default().notify(if listen {
                    Notify::Debounced(Duration::from_millis(10))
                } else {
                    Notify::Off
                });
                // each commit's event id and when it returned
                std::thread::spawn(move || -> Result<Vec<(String, Instant)>> {
                    let mut conn = PgConnection::establish(&url)?;
                    let mut committed = Vec::with_capacity(total / 4 + 1);
                    let interval = Duration::from_secs_f64(4.0 / rate as f64);
                    let start = Instant::now();
                    for i in (w..total).step_by(4) {
                        let due = start + interval * (i / 4) as u32;
                        if let Some(wait) = due.checked_duration_since(Instant::now()) {
                            std::thread::sleep(wait);
                        }
                        let id = conn.transaction(|c| c.record_event_in(&outbox, &event(i)))?;
                        committed.push((id.to_string(), Instant::now()));
                    }
                    Ok(committed)
                })
            })
            .collect();
        // each message's id and arrival; matched with the commits once the writers are done
        // (a subscriber that waited for a commit's record held every message behind it)
        let mut arrivals = Vec::with_capacity(total);
        let deadline = Instant::now() + duration + Duration::from_secs(30);
        while arrivals.len() < total && Instant::now() < deadline {
            let Ok(Some(msg)) = tokio::time::timeout(Duration::from_secs(5), sub.next()).await
            else {
                break;
            };
            let now = Instant::now();
            if let Some(id) = msg.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id")) {
                arrivals.push((id.to_string(), now));
            }
        }
        let mut committed = HashMap::with_capacity(total);
        for w in writers {
            committed.extend(w.join().map_err(|_| anyhow::anyhow!("writer panicked"))??);
        }
        // (seconds from the start to the commit, ms to the message)
        let mut trace: Vec<(f64, f64)> = arrivals
            .into_iter()
            .filter_map(|(id, arrived)| {
                let at = committed.get(&id)?;
                let ms = arrived.saturating_duration_since(*at).as_secs_f64() * 1000.0;
                Some((at.saturating_duration_since(started).as_secs_f64(), ms))
            })
            .collect();
        let cpu = CpuUse::between(&cpu_before, &cpu_snapshot(), total, &[]);
        shutdown.cancel();
        relay.await??;
        if wake == Wake::Tailing {
            self.drop_slot(&slot)?;
        }
        if let Some(path) = &self.args.latency_trace {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?;
            trace.sort_by(|a, b| a.0.total_cmp(&b.0));
            for (at, ms) in &trace {
                writeln!(f, "{rate}/{tag} {at:.4} {ms:.3}")?;
            }
        }
        let mut latencies: Vec<f64> = trace.into_iter().map(|(_, ms)| ms).collect();
        latencies.sort_by(|a, b| a.total_cmp(b));
        if latencies.is_empty() {
            bail!("no message arrived");
        }
        let pct =
            |p: f64| latencies[((latencies.len() as f64 * p) as usize).min(latencies.len() - 1)];
        Ok((
            pct(0.50),
            pct(0.99),
            latencies[latencies.len() - 1],
            cpu.postgres,
        ))
    }
}

/// How the relay of a latency run learns of a commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum Wake {
    /// A polling relay woken by the recording side's `NOTIFY`.
    Notify,
    /// The same without reading again after a read that found rows (`--linger 0`).
    NotifyNoLinger,
    /// A polling relay, polling only.
    Poll,
    /// The log-tailing relay.
    Tailing,
}

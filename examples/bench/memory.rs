//! Section 5: the relay's peak memory while draining a backlog, and with large rows.

use super::*;

impl Bench {
    /// Section 5.
    pub(super) async fn memory(&mut self) -> Result<()> {
        let n = self.args.memory_backlog;
        println!("\n## 5. relay memory: peak RSS of `outbox-relay` draining {n} rows\n");
        println!("| relay | backlog | drained in | events/s | peak RSS |");
        println!("|---|---|---|---|---|");
        self.memory_run(n, None).await?;
        self.memory_large(self.args.large_rows, "ordered").await?;
        self.memory_large(self.args.large_rows, "unordered").await?;
        if self.wal_level()? == "logical" {
            self.memory_run(n, Some(100)).await?;
            self.memory_run(n, Some(n)).await?;
        } else {
            println!("| log-tailing | skipped: `wal_level` is not `logical` | | | |");
        }
        Ok(())
    }

    /// One drain of `n` rows of 900 KB payloads by a relay in `mode` with its defaults
    /// (`--max-batch-bytes` 8 MiB; unordered: 4 workers), sampling its peak RSS.
    pub(super) async fn memory_large(&mut self, n: usize, mode: &str) -> Result<()> {
        use diesel::RunQueryDsl;
        self.reset_outbox()?;
        let mut conn = PgConnection::establish(&self.db_url)?;
        diesel::sql_query("SET synchronous_commit = off").execute(&mut conn)?;
        for start in (0..n).step_by(50) {
            // 900 KB of JSON text each: 28,125 md5 digests of 32 characters
            diesel::sql_query(format!(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                 SELECT gen_random_uuid(), 'blob', 'blob-' || (i % 100), 'blob.stored', \
                 jsonb_build_object('i', i, 'data', repeat(md5(i::text), 28125)) \
                 FROM generate_series({start}, {}) i",
                (start + 50).min(n) - 1
            ))
            .execute(&mut conn)?;
        }
        let (name, prefix) = ("BENCH_MEM_LARGE", "benchmemlarge");
        self.stream(name, prefix).await?;
        let args = ["--mode", mode, "--no-cleanup"].map(String::from);
        let child = self.spawn_relay(name, prefix, &args)?;
        let start = Instant::now();
        let mut peak_kb = 0u64;
        while self.left(name, n).await? {
            peak_kb = peak_kb.max(vm_hwm_kb(child.id()).unwrap_or(0));
            tokio::time::sleep(Duration::from_millis(100)).await;
            if start.elapsed() > Duration::from_secs(900) {
                bail!("the relay did not drain the large rows in 15 minutes");
            }
        }
        peak_kb = peak_kb.max(vm_hwm_kb(child.id()).unwrap_or(0));
        let elapsed = start.elapsed().as_secs_f64();
        drop(child);
        println!(
            "| {mode}, 900 KB payloads | {n} | {elapsed:.1} s | {:.0} | {:.1} MiB |",
            n as f64 / elapsed,
            peak_kb as f64 / 1024.0
        );
        Ok(())
    }

    /// One drain of `n` rows by an `ordered` relay, or a log-tailing one with the backlog in
    /// transactions of `per_tx` events (`Some(n)`: one transaction), sampling its peak RSS.
    pub(super) async fn memory_run(&mut self, n: usize, per_tx: Option<usize>) -> Result<()> {
        self.reset_outbox()?;
        let tailing = per_tx.is_some();
        let slot = format!("{}_slot", self.db_name);
        let mut args = Vec::new();
        if let Some(per_tx) = per_tx {
            self.create_slot(&slot)?;
            self.fill_rows(n, per_tx, false)?;
            args.extend(["--mode", "log-tailing", "--slot", &slot].map(String::from));
        } else {
            self.fill(n, false)?;
        }
        let (name, prefix) = if tailing {
            ("BENCH_MEM_LT", "benchmemlt")
        } else {
            ("BENCH_MEM", "benchmem")
        };
        self.stream(name, prefix).await?;
        let child = self.spawn_relay(name, prefix, &args)?;
        let start = Instant::now();
        let mut peak_kb = 0u64;
        loop {
            if !self.left(name, n).await? {
                break;
            }
            peak_kb = peak_kb.max(vm_hwm_kb(child.id()).unwrap_or(0));
            tokio::time::sleep(Duration::from_millis(100)).await;
            if start.elapsed() > Duration::from_secs(900) {
                bail!("the relay did not drain the backlog in 15 minutes");
            }
        }
        peak_kb = peak_kb.max(vm_hwm_kb(child.id()).unwrap_or(0));
        let elapsed = start.elapsed().as_secs_f64();
        drop(child);
        if tailing {
            self.drop_slot(&slot)?;
        }
        let relay = match per_tx {
            None => "ordered".to_owned(),
            Some(m) if m >= n => "log-tailing, one transaction".to_owned(),
            Some(m) => format!("log-tailing, transactions of {m}"),
        };
        println!(
            "| {relay} | {n} | {elapsed:.1} s | {:.0} | {:.1} MiB |",
            n as f64 / elapsed,
            peak_kb as f64 / 1024.0
        );
        Ok(())
    }
}

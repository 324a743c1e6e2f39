//! The processes a run measures: CPU time and peak memory from `/proc`, the `outbox-relay`
//! binary, the servers' versions.

use super::*;

/// CPU seconds used so far by every process: pid → (command name, seconds). A PostgreSQL
/// process counts its reaped children too: the postmaster's are the backends (and workers)
/// that have exited, so sessions that end during a run are counted.
pub(super) fn cpu_snapshot() -> HashMap<u32, (String, f64)> {
    let mut out = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in dir.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ...`: the name may hold spaces, so split at the last `)`
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = stat[open + 1..close].to_owned();
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // utime and stime are fields 14 and 15; `fields` starts at field 3; USER_HZ is 100
        let ticks = |i: usize| {
            fields
                .get(i)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        // cutime and cstime (16 and 17): the children's, once reaped
        let children = if comm == "postgres" {
            ticks(13) + ticks(14)
        } else {
            0.0
        };
        out.insert(pid, (comm, (ticks(11) + ticks(12) + children) / 100.0));
    }
    out
}

/// The CPU a process has used so far (user and system), in seconds; 0 when it is gone.
pub(super) fn process_cpu_secs(pid: u32) -> f64 {
    cpu_snapshot().get(&pid).map_or(0.0, |(_, secs)| *secs)
}

/// CPU µs per event spent by PostgreSQL, nats-server and this process (the relay or the
/// publisher) between two snapshots.
#[derive(Clone, Copy, Default)]
pub(super) struct CpuUse {
    pub(super) postgres: f64,
    pub(super) nats: f64,
    pub(super) own: f64,
}

impl CpuUse {
    pub(super) fn between(
        before: &HashMap<u32, (String, f64)>,
        after: &HashMap<u32, (String, f64)>,
        events: usize,
        own: &[u32],
    ) -> Self {
        // each kind's total after less its total before: a process gone since (a PostgreSQL
        // session that ended) is in the postmaster's reaped children's time after
        let mut u = CpuUse::default();
        for (snapshot, sign) in [(after, 1.0), (before, -1.0)] {
            for (pid, (comm, secs)) in snapshot {
                let per_event = sign * secs * 1e6 / events.max(1) as f64;
                if own.contains(pid) {
                    u.own += per_event;
                } else if comm == "postgres" {
                    u.postgres += per_event;
                } else if comm == "nats-server" {
                    u.nats += per_event;
                }
            }
        }
        u
    }

    pub(super) fn median(all: &[CpuUse]) -> CpuUse {
        let pick = |f: fn(&CpuUse) -> f64| median(&mut all.iter().map(f).collect::<Vec<_>>());
        CpuUse {
            postgres: pick(|c| c.postgres),
            nats: pick(|c| c.nats),
            own: pick(|c| c.own),
        }
    }
}

/// The `outbox-relay` binary beside this example (`target/release/outbox-relay`).
pub(super) fn relay_bin() -> Result<std::path::PathBuf> {
    let bin = std::env::current_exe()?
        .parent()
        .and_then(|p| p.parent())
        .map(|p| p.join("outbox-relay"))
        .context("target dir")?;
    if !bin.exists() {
        bail!(
            "{} is missing: cargo build --release --workspace --bins first",
            bin.display()
        );
    }
    Ok(bin)
}

/// A relay process, stopped with SIGTERM (and waited for) when dropped.
pub(super) struct RelayProcess(pub(super) std::process::Child);

impl RelayProcess {
    pub(super) fn id(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

pub(super) fn vm_hwm_kb(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

pub(super) fn num_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

pub(super) fn server_versions(conn: &mut PgConnection, nats: &async_nats::Client) -> String {
    use diesel::RunQueryDsl;
    #[derive(QueryableByName)]
    struct V {
        #[diesel(sql_type = diesel::sql_types::Text)]
        v: String,
    }
    let pg = diesel::sql_query("SELECT current_setting('server_version') AS v")
        .get_result::<V>(conn)
        .map(|v| v.v)
        .unwrap_or_default();
    format!(
        "PostgreSQL {pg}, nats-server {}",
        nats.server_info().version
    )
}

//! Counting what a relay asks PostgreSQL: a database on a cluster of its own with
//! `pg_stat_statements`, and the calls and plans of the statements whose text matches.

use super::{TestDb, servers};

impl TestDb {
    /// A database on a cluster of its own that counts the statements it runs and plans
    /// (`pg_stat_statements`), for [`TestDb::calls_and_plans`]; the cluster goes with the
    /// returned guard.
    pub fn counting_statements() -> (servers::PgCluster, Self) {
        let cluster = servers::PgCluster::start_with(&[
            "shared_preload_libraries=pg_stat_statements",
            "pg_stat_statements.track=all",
            "pg_stat_statements.track_planning=on",
        ]);
        let db = Self::on(&cluster.base_url());
        db.execute("CREATE EXTENSION pg_stat_statements", "pg_stat_statements");
        (cluster, db)
    }

    /// How many times the statements matching `pattern` (`LIKE`, on the text
    /// `pg_stat_statements` keeps, each constant a `$n`) ran on a database of
    /// [`TestDb::counting_statements`]'s server so far, and how many times they were planned.
    pub fn calls_and_plans(&self, pattern: &str) -> (i64, i64) {
        let counts = |what: &str| {
            self.scalar(&format!(
                "SELECT COALESCE(sum({what}), 0)::int8 FROM pg_stat_statements \
                 WHERE query LIKE '{pattern}'"
            ))
        };
        (counts("calls"), counts("plans"))
    }
}

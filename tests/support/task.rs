//! A task of the library (an in-process relay, a consumer) running in this process until it
//! is stopped, or cancelled on `Drop`.

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A spawned task that runs until its shutdown token is cancelled.
pub struct Running<E> {
    shutdown: CancellationToken,
    task: Option<JoinHandle<Result<(), E>>>,
    what: &'static str,
}

impl<E: std::fmt::Debug + Send + 'static> Running<E> {
    /// Spawns `run` with a shutdown token of its own; `what` names it in failures.
    pub fn spawn<F>(what: &'static str, run: impl FnOnce(CancellationToken) -> F) -> Self
    where
        F: Future<Output = Result<(), E>> + Send + 'static,
    {
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(shutdown.clone()));
        Running {
            shutdown,
            task: Some(task),
            what,
        }
    }

    /// Cancels it and waits (at most 10 s) for it to return `Ok`.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(t) = self.task.take() {
            let what = self.what;
            tokio::time::timeout(Duration::from_secs(10), t)
                .await
                .unwrap_or_else(|_| panic!("{what} stops within 10 s"))
                .unwrap_or_else(|e| panic!("{what} task: {e:?}"))
                .unwrap_or_else(|e| panic!("{what} result: {e:?}"));
        }
    }
}

impl<E> Drop for Running<E> {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

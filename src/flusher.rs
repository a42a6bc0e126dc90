//! The output flusher thread (Flink's `OutputFlusher`): makes partly filled buffers readable
//! every buffer-timeout interval. Kept out of `partition/`, which never sleeps or reads the
//! clock.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread;
use std::time::Duration;

use crate::partition::PartitionHandle;

/// A running flusher; dropping it stops the thread and waits for it.
pub struct OutputFlusher {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<thread::JoinHandle<()>>,
}

impl fmt::Debug for OutputFlusher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutputFlusher").finish_non_exhaustive()
    }
}

impl OutputFlusher {
    /// Flushes `partition` every `interval` (at least 1 ms: a zero interval would make the
    /// thread spin) until dropped. Fails when the thread cannot be started.
    pub fn start(partition: PartitionHandle, interval: Duration) -> std::io::Result<Self> {
        let interval = interval.max(Duration::from_millis(1));
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let signal = stop.clone();
        let thread = thread::Builder::new()
            .name("fluxgate-flusher".into())
            .spawn(move || {
                let (lock, cond) = &*signal;
                loop {
                    let stopped = lock.lock().unwrap_or_else(PoisonError::into_inner);
                    let (stopped, _) = cond
                        .wait_timeout_while(stopped, interval, |stopped| !*stopped)
                        .unwrap_or_else(PoisonError::into_inner);
                    if *stopped {
                        return;
                    }
                    drop(stopped);
                    // A reader's listener that panics costs that notification, not the
                    // flusher: ended, it would leave every later partial buffer of the
                    // partition unread until its writer finished it.
                    let flushed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        partition.flush_all();
                    }));
                    if flushed.is_err() {
                        tracing::error!(
                            "a reader's availability listener panicked during a timed flush"
                        );
                    }
                }
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for OutputFlusher {
    fn drop(&mut self) {
        *self.stop.0.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.stop.1.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

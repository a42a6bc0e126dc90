//! A progress bar on stderr for runs planned to take longer than two seconds, shown only when
//! stderr is a terminal (piped or redirected runs stay quiet). The run is a plan of timed
//! phases; a ticker thread moves the bar with the clock through the phase that is running.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Runs planned at or under this length show no bar.
const QUIET_UP_TO: Duration = Duration::from_secs(2);
/// How often the ticker moves the bar.
const TICK: Duration = Duration::from_millis(100);

/// The phase running: where it starts on the bar and how long it is planned to take.
#[derive(Clone, Copy)]
struct Running {
    started: Instant,
    offset: Duration,
    length: Duration,
}

struct Shown {
    bar: ProgressBar,
    running: Arc<Mutex<Running>>,
    stop: Arc<AtomicBool>,
    ticker: Option<JoinHandle<()>>,
}

/// The bar of one run (hidden when not shown: every call is then a no-op).
pub struct Progress {
    phases: Vec<(&'static str, Duration)>,
    shown: Option<Shown>,
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Progress")
            .field("phases", &self.phases)
            .field("shown", &self.shown.is_some())
            .finish()
    }
}

impl Progress {
    /// A bar over `phases` (name, planned length), on stderr if it is a terminal and the plan
    /// is longer than two seconds.
    pub fn new(phases: &[(&'static str, Duration)]) -> Self {
        Self::with_terminal(phases, std::io::stderr().is_terminal())
    }

    fn with_terminal(phases: &[(&'static str, Duration)], terminal: bool) -> Self {
        let total: Duration = phases.iter().map(|p| p.1).sum();
        let shown = (terminal && total > QUIET_UP_TO).then(|| {
            let bar = ProgressBar::with_draw_target(
                Some(total.as_millis() as u64),
                ProgressDrawTarget::stderr(),
            );
            bar.set_style(
                ProgressStyle::with_template("{msg:<22} [{bar:40}] {elapsed:>4} of ~{len_s}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .with_key(
                        "len_s",
                        |state: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                            let _ = write!(w, "{:.0}s", state.len().unwrap_or(0) as f64 / 1000.0);
                        },
                    )
                    .progress_chars("=> "),
            );
            let running = Arc::new(Mutex::new(Running {
                started: Instant::now(),
                offset: Duration::ZERO,
                length: Duration::ZERO,
            }));
            let stop = Arc::new(AtomicBool::new(false));
            let ticker = {
                let (bar, running, stop) = (bar.clone(), running.clone(), stop.clone());
                thread::spawn(move || {
                    // Ends when the Progress is dropped.
                    while !stop.load(Ordering::Relaxed) {
                        // Under the lock: a position from the phase before cannot land after
                        // `phase` set the new one.
                        let now = running.lock().expect("not poisoned");
                        let within = now.started.elapsed().min(now.length);
                        bar.set_position((now.offset + within).as_millis() as u64);
                        drop(now);
                        thread::sleep(TICK);
                    }
                })
            };
            Shown {
                bar,
                running,
                stop,
                ticker: Some(ticker),
            }
        });
        Self {
            phases: phases.to_vec(),
            shown,
        }
    }

    /// True if the bar is drawn.
    #[cfg(test)]
    fn is_shown(&self) -> bool {
        self.shown.is_some()
    }

    /// Phase `name` of the plan starts now (the bar jumps to where it begins).
    pub fn phase(&self, name: &str) {
        let Some(shown) = &self.shown else { return };
        let index = self.phases.iter().position(|p| p.0 == name);
        let offset = self.phases[..index.unwrap_or(self.phases.len())]
            .iter()
            .map(|p| p.1)
            .sum();
        let length = index.map_or(Duration::ZERO, |i| self.phases[i].1);
        let mut running = shown.running.lock().expect("not poisoned");
        *running = Running {
            started: Instant::now(),
            offset,
            length,
        };
        shown.bar.set_message(name.to_string());
        shown.bar.set_position(offset.as_millis() as u64);
        drop(running);
    }

    /// Runs `f` (which prints to the terminal) with the bar hidden, then redraws it.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.shown {
            Some(shown) => shown.bar.suspend(f),
            None => f(),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(shown) = &mut self.shown {
            shown.stop.store(true, Ordering::Relaxed);
            if let Some(ticker) = shown.ticker.take() {
                let _ = ticker.join();
            }
            shown.bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LONG: [(&str, Duration); 2] = [
        ("throughput", Duration::from_secs(2)),
        ("latency", Duration::from_secs(1)),
    ];

    #[test]
    fn quiet_unless_a_terminal_and_longer_than_two_seconds() {
        assert!(!Progress::with_terminal(&LONG, false).is_shown());
        assert!(!Progress::with_terminal(&[("short", Duration::from_secs(2))], true).is_shown());
        // Drawn to stderr, which under the test harness is not a terminal: the bar exists
        // but indicatif draws nothing there.
        let progress = Progress::with_terminal(&LONG, true);
        assert!(progress.is_shown());
        progress.phase("latency");
        let shown = progress.shown.as_ref().unwrap();
        assert!((2000..=3000).contains(&shown.bar.position()));
        assert_eq!(shown.bar.length(), Some(3000));
        assert_eq!(progress.suspend(|| 7), 7);
    }
}

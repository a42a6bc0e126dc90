//! CPU pinning for `fluxgate bench --pin-cpus P,C`: the producer side of an exchange on CPU
//! P, the consumer side on CPU C, for the engine and the raw-TCP baseline alike.
//!
//! On a machine whose idle CPUs halt (a virtual machine's vCPUs, see the README), where a
//! thread is woken decides what the wake-up costs: a thread woken on a halted CPU waits for
//! that CPU to come back, one woken on the CPU its waker is about to leave runs at once.
//! Pinning each process (its task threads with its I/O thread) to one CPU keeps the
//! hand-offs inside a process on one CPU; only the socket crosses, as with raw TCP.

use std::fmt;
use std::str::FromStr;

use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};

/// Where each side of the exchange runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pinning {
    /// The producer process (its producer tasks and its I/O thread), and the baseline's
    /// writer.
    pub producer: usize,
    /// The consumer process (its consumer tasks and its I/O thread), and the baseline's
    /// reader.
    pub consumer: usize,
}

impl FromStr for Pinning {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let cpu = |part: Option<&str>| {
            part.and_then(|p| p.trim().parse::<usize>().ok())
                .filter(|&cpu| cpu < CpuSet::MAX_CPU)
        };
        let mut parts = text.split(',');
        match (cpu(parts.next()), cpu(parts.next()), parts.next()) {
            (Some(producer), Some(consumer), None) => Ok(Self { producer, consumer }),
            _ => Err(format!(
                "`{text}` is not `P,C` (the producer side's CPU, then the consumer side's)"
            )),
        }
    }
}

impl fmt::Display for Pinning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{},{}", self.producer, self.consumer)
    }
}

/// Pins the calling thread to `cpu`; threads it starts afterwards inherit the pinning.
pub fn pin_current_thread(cpu: usize) -> Result<(), String> {
    let mut set = CpuSet::new();
    set.set(cpu);
    sched_setaffinity(None, &set).map_err(|e| format!("pinning a thread to CPU {cpu}: {e}"))
}

/// The calling thread's CPUs now, to [`restore`] later.
pub fn current_cpus() -> Result<CpuSet, String> {
    sched_getaffinity(None).map_err(|e| format!("reading a thread's CPUs: {e}"))
}

/// Gives the calling thread back the CPUs [`current_cpus`] returned.
pub fn restore(cpus: &CpuSet) -> Result<(), String> {
    sched_setaffinity(None, cpus).map_err(|e| format!("restoring a thread's CPUs: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinning_reads_two_cpus_and_nothing_else() {
        assert_eq!(
            "0,1".parse::<Pinning>(),
            Ok(Pinning {
                producer: 0,
                consumer: 1
            })
        );
        assert_eq!(
            " 3 , 2 ".parse::<Pinning>().map(|p| p.to_string()),
            Ok("3,2".into())
        );
        for bad in ["", "0", "0,", "a,1", "0,1,2", "-1,0"] {
            assert!(bad.parse::<Pinning>().is_err(), "{bad}");
        }
    }
}

//! Configuration: every option with the name Flink gives it where one matches, its default,
//! and the relations between options checked in one place.

use std::time::Duration;

/// Why a configuration value was refused.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// No option has this name.
    #[error("unknown option `{0}`")]
    UnknownOption(String),
    /// The value does not parse or is out of range.
    #[error("invalid value `{value}` for `{key}`: {reason}")]
    InvalidValue {
        /// The option.
        key: String,
        /// What was given.
        value: String,
        /// What was wrong with it.
        reason: String,
    },
}

/// Network memory and exchange options of one process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetworkConfig {
    /// `taskmanager.memory.segment-size`: payload bytes per segment, a power of two from 4 KiB
    /// to 1 MiB (default 32 KiB). Each segment also reserves [`crate::buffer::HEADROOM`] bytes.
    pub segment_size: usize,
    /// `taskmanager.memory.network.max`: total payload bytes of network memory, allocated at
    /// start (default 64 MiB).
    pub network_memory_bytes: usize,
    /// Bytes per arena (one io_uring fixed buffer each; at most 1 GiB; default 64 MiB).
    pub arena_bytes: usize,
    /// `taskmanager.network.memory.buffers-per-channel`: exclusive buffers per remote input
    /// channel (default 2).
    pub buffers_per_channel: usize,
    /// `taskmanager.network.memory.floating-buffers-per-gate`: buffers an input gate shares
    /// among its channels on demand (default 8).
    pub floating_buffers_per_gate: usize,
    /// `taskmanager.network.memory.max-buffers-per-channel`: most buffers one subpartition may
    /// hold, so a skewed one backpressures instead of taking the whole pool (default 10).
    pub max_buffers_per_channel: usize,
    /// `taskmanager.network.memory.exclusive-buffers-request-timeout-ms` (default 30 s).
    pub buffer_request_timeout: Duration,
    /// Largest record a deserializer accepts; a longer length prefix is a corrupt stream
    /// (default 64 MiB).
    pub max_record_bytes: usize,
    /// `taskmanager.network.request-backoff.initial`: the first delay before a partition
    /// request (or a refused connection) is retried (default 100 ms).
    pub request_backoff_initial: Duration,
    /// `taskmanager.network.request-backoff.max`: the delay doubles up to this, and a request
    /// still refused after a retry at this delay fails with PartitionNotFound (or a transport
    /// error for a refused connection) (default 10 s).
    pub request_backoff_max: Duration,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        Self {
            segment_size: 32 * 1024,
            network_memory_bytes: 64 * 1024 * 1024,
            arena_bytes: 64 * 1024 * 1024,
            buffers_per_channel: 2,
            floating_buffers_per_gate: 8,
            max_buffers_per_channel: 10,
            buffer_request_timeout: Duration::from_secs(30),
            max_record_bytes: 64 * 1024 * 1024,
            request_backoff_initial: Duration::from_millis(100),
            request_backoff_max: Duration::from_secs(10),
        }
    }
}

impl NetworkConfig {
    /// Option names as `fluxgate` accepts them on the command line and in files.
    pub const OPTIONS: &'static [&'static str] = &[
        "taskmanager.memory.segment-size",
        "taskmanager.memory.network.max",
        "fluxgate.memory.arena-size",
        "taskmanager.network.memory.buffers-per-channel",
        "taskmanager.network.memory.floating-buffers-per-gate",
        "taskmanager.network.memory.max-buffers-per-channel",
        "taskmanager.network.memory.exclusive-buffers-request-timeout-ms",
        "fluxgate.record.max-size",
        "taskmanager.network.request-backoff.initial",
        "taskmanager.network.request-backoff.max",
    ];

    /// Sets one option by name. Sizes accept `k`, `kb`, `m`, `mb`, `g`, `gb` suffixes.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let invalid = |reason: &str| ConfigError::InvalidValue {
            key: key.to_owned(),
            value: value.to_owned(),
            reason: reason.to_owned(),
        };
        let size = || parse_size(value).ok_or_else(|| invalid("expected a size like 32kb"));
        let count = || {
            value
                .parse::<usize>()
                .map_err(|_| invalid("expected a non-negative integer"))
        };
        let mut next = self.clone();
        match key {
            "taskmanager.memory.segment-size" => next.segment_size = size()?,
            "taskmanager.memory.network.max" => next.network_memory_bytes = size()?,
            "fluxgate.memory.arena-size" => next.arena_bytes = size()?,
            "taskmanager.network.memory.buffers-per-channel" => next.buffers_per_channel = count()?,
            "taskmanager.network.memory.floating-buffers-per-gate" => {
                next.floating_buffers_per_gate = count()?
            }
            "taskmanager.network.memory.max-buffers-per-channel" => {
                next.max_buffers_per_channel = count()?
            }
            "taskmanager.network.memory.exclusive-buffers-request-timeout-ms" => {
                next.buffer_request_timeout = Duration::from_millis(count()? as u64)
            }
            "fluxgate.record.max-size" => next.max_record_bytes = size()?,
            "taskmanager.network.request-backoff.initial" => {
                next.request_backoff_initial = Duration::from_millis(count()? as u64)
            }
            "taskmanager.network.request-backoff.max" => {
                next.request_backoff_max = Duration::from_millis(count()? as u64)
            }
            _ => return Err(ConfigError::UnknownOption(key.to_owned())),
        }
        next.validate().map_err(|e| match e {
            ConfigError::InvalidValue { reason, .. } => invalid(&reason),
            other => other,
        })?;
        *self = next;
        Ok(())
    }

    /// Checks every option's range and the relations between options.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, value: usize, reason: &str| {
            Err(ConfigError::InvalidValue {
                key: key.to_owned(),
                value: value.to_string(),
                reason: reason.to_owned(),
            })
        };
        let s = self.segment_size;
        if !s.is_power_of_two() || !(4096..=1 << 20).contains(&s) {
            return invalid(
                "taskmanager.memory.segment-size",
                s,
                "must be a power of two from 4 KiB to 1 MiB",
            );
        }
        if self.network_memory_bytes < s {
            return invalid(
                "taskmanager.memory.network.max",
                self.network_memory_bytes,
                "must hold at least one segment",
            );
        }
        if self.network_memory_bytes / s > u32::MAX as usize / 2 {
            return invalid(
                "taskmanager.memory.network.max",
                self.network_memory_bytes,
                "too many segments for 31-bit handles",
            );
        }
        if self.arena_bytes < s + crate::buffer::HEADROOM || self.arena_bytes > 1 << 30 {
            return invalid(
                "fluxgate.memory.arena-size",
                self.arena_bytes,
                "must hold one segment and be at most 1 GiB (io_uring's fixed-buffer limit)",
            );
        }
        if self.max_buffers_per_channel == 0 {
            return invalid(
                "taskmanager.network.memory.max-buffers-per-channel",
                0,
                "must be at least 1",
            );
        }
        if self.max_record_bytes == 0 || self.max_record_bytes > i32::MAX as usize {
            return invalid(
                "fluxgate.record.max-size",
                self.max_record_bytes,
                "must be from 1 byte to 2 GiB - 1",
            );
        }
        if self.request_backoff_initial.is_zero()
            || self.request_backoff_max < self.request_backoff_initial
        {
            return invalid(
                "taskmanager.network.request-backoff.max",
                self.request_backoff_max.as_millis() as usize,
                "the initial back-off must be above 0 ms and at most the maximum",
            );
        }
        Ok(())
    }

    /// The partition-request back-off these options describe.
    pub fn request_backoff(&self) -> crate::gate::Backoff {
        crate::gate::Backoff::new(self.request_backoff_initial, self.request_backoff_max)
    }

    /// Segments in the whole network memory.
    pub fn segment_count(&self) -> usize {
        self.network_memory_bytes / self.segment_size
    }
}

/// Parses `123`, `32k`, `32kb`, `64m`, `1g` (binary units, case-insensitive).
fn parse_size(text: &str) -> Option<usize> {
    let text = text.trim().to_ascii_lowercase();
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(digits_end);
    let value: usize = digits.parse().ok()?;
    let multiplier = match unit.trim() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return None,
    };
    value.checked_mul(multiplier)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("32kb"), Some(32 * 1024));
        assert_eq!(parse_size("64M"), Some(64 << 20));
        assert_eq!(parse_size("1g"), Some(1 << 30));
        assert_eq!(parse_size("12q"), None);
        assert_eq!(parse_size(""), None);
    }

    #[test]
    fn segment_size_must_be_a_power_of_two_in_range() {
        let mut config = NetworkConfig::default();
        assert!(config.set("taskmanager.memory.segment-size", "4k").is_ok());
        assert!(config.set("taskmanager.memory.segment-size", "1m").is_ok());
        assert!(config.set("taskmanager.memory.segment-size", "2m").is_err());
        assert!(config
            .set("taskmanager.memory.segment-size", "5000")
            .is_err());
        assert!(config.set("taskmanager.memory.segment-size", "2k").is_err());
        assert!(matches!(
            config.set("no.such.option", "1"),
            Err(ConfigError::UnknownOption(_))
        ));
    }
}

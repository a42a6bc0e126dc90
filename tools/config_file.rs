//! `--config FILE.toml` of the commands that take one (`bench`, `stress`): Flink option names
//! and values for [`NetworkConfig::set`], read the same way everywhere.

use std::collections::BTreeSet;
use std::path::Path;

use fluxgate::config::ConfigError;
use fluxgate::NetworkConfig;

/// The options of a config file as `(Flink name, value)` strings, in file order. Nested tables
/// join their keys with dots, so `taskmanager.memory.segment-size = "16kb"` (a dotted key) and
/// the quoted `"taskmanager.memory.segment-size" = "16kb"` mean the same. Values are strings
/// or integers.
pub fn read_options(path: &Path) -> Result<Vec<(String, String)>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read config file `{}`: {e}", path.display()))?;
    let table: toml::Table = toml::from_str(&text).map_err(|e| {
        format!(
            "config file `{}`: {}",
            path.display(),
            e.to_string().trim_end()
        )
    })?;
    let mut leaves = Vec::new();
    flatten("", &table, &mut leaves);
    leaves
        .into_iter()
        .map(|(key, value)| match value {
            toml::Value::String(s) => Ok((key, s.clone())),
            toml::Value::Integer(i) => Ok((key, i.to_string())),
            other => Err(format!(
                "config file `{}`: `{key}`: expected a string or an integer, got {}",
                path.display(),
                other.type_str()
            )),
        })
        .collect()
}

/// Applies a config file to `config`; returns the names it set. A bad key or value is an
/// error naming the file (and, for an unknown key, the known ones).
pub fn apply_config_file(
    path: &Path,
    config: &mut NetworkConfig,
) -> Result<BTreeSet<String>, String> {
    let options = read_options(path)?;
    apply(path, &options, config)?;
    Ok(options.into_iter().map(|(key, _)| key).collect())
}

/// A config file's options, checked against a default [`NetworkConfig`] first, to hand on to
/// other processes (the `[network]` table of a generated topology).
pub fn checked_options(path: &Path) -> Result<Vec<(String, String)>, String> {
    let options = read_options(path)?;
    apply(path, &options, &mut NetworkConfig::default())?;
    Ok(options)
}

/// Sets `options` (read from `path`) on `config`, all at once: the relations between them
/// are checked after every one is set, so their order in the file does not matter.
fn apply(
    path: &Path,
    options: &[(String, String)],
    config: &mut NetworkConfig,
) -> Result<(), String> {
    config
        .set_all(options.iter().map(|(k, v)| (k, v)))
        .map_err(|e| match e {
            ConfigError::UnknownOption(_) => format!(
                "config file `{}`: {e} (known options: {})",
                path.display(),
                NetworkConfig::OPTIONS.join(", ")
            ),
            _ => format!("config file `{}`: {e}", path.display()),
        })
}

/// The leaves of `table` as (dotted key, value).
fn flatten<'a>(prefix: &str, table: &'a toml::Table, out: &mut Vec<(String, &'a toml::Value)>) {
    for (key, value) in table {
        let key = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        match value {
            toml::Value::Table(inner) => flatten(&key, inner, out),
            leaf => out.push((key, leaf)),
        }
    }
}

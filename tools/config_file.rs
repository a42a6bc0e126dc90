//! `--config FILE.toml` of the commands that take one (`bench`, `stress`): Flink option names
//! and values for [`NetworkConfig::set`], read the same way everywhere.

use std::collections::BTreeSet;
use std::path::Path;

use fluxgate::config::ConfigError;
use fluxgate::NetworkConfig;

/// The options of a config file as `(Flink name, value)` strings, in the TOML table's key
/// order, not the file's (their order does not matter: they are set all at once). Nested tables
/// join their keys with dots, so `taskmanager.memory.segment-size = "16kb"` (a dotted key) and
/// the quoted `"taskmanager.memory.segment-size" = "16kb"` mean the same. Values are strings,
/// integers or booleans (`security.ssl.internal.enabled = true`).
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
        .map(|(key, value)| match option_text(value) {
            Ok(text) => Ok((key, text)),
            Err(refused) => Err(format!(
                "config file `{}`: `{key}`: {refused}",
                path.display()
            )),
        })
        .collect()
}

/// An option's TOML value as the text [`NetworkConfig::set`] takes: a string as it is, an
/// integer or a boolean written out; any other type is refused, saying what it was.
pub fn option_text(value: &toml::Value) -> Result<String, String> {
    match value {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        other => Err(format!(
            "expected a string, an integer or a boolean, got {}",
            other.type_str()
        )),
    }
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

/// Sets `options` (read from `path`, perhaps with options added to them) on `config`, all at
/// once: the relations between them are checked after every one is set, so their order (in
/// the file, or the added ones against the file's) does not matter.
pub fn apply(
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The README writes `security.ssl.internal.enabled = true`: a bare TOML boolean reads as
    /// the option's value, as the string "true" does (it was refused as not a string).
    #[test]
    fn a_boolean_value_reads_as_the_option_s_value() {
        let dir = std::env::temp_dir().join(format!("fluxgate-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bool.toml");
        std::fs::write(
            &path,
            "security.ssl.internal.enabled = false\n\"fluxgate.network.zero-copy-send\" = \"off\"\n",
        )
        .unwrap();
        let options = read_options(&path);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            options.unwrap(),
            [
                (
                    "fluxgate.network.zero-copy-send".to_owned(),
                    "off".to_owned()
                ),
                (
                    "security.ssl.internal.enabled".to_owned(),
                    "false".to_owned()
                ),
            ]
        );
    }
}

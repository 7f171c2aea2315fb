//! Layering TOML values: a preset, then a file, then `--set key=value` overrides.

use toml::Value;

use crate::ConfigError;

pub(crate) fn merge(base: &mut Value, top: Value) {
    match (base, top) {
        (Value::Table(b), Value::Table(t)) => {
            for (k, v) in t {
                match b.get_mut(&k) {
                    // A new optimizer kind replaces the whole table so stale
                    // hyper-parameters of the old kind are not carried over.
                    Some(existing)
                        if v.get("kind").is_none() || v.get("kind") == existing.get("kind") =>
                    {
                        merge(existing, v)
                    }
                    _ => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, t) => *b = t,
    }
}

pub(crate) fn apply_override(value: &mut Value, assignment: &str) -> Result<(), ConfigError> {
    let (key, raw) = assignment
        .split_once('=')
        .ok_or_else(|| ConfigError::Invalid(format!("--set {assignment:?}: expected key=value")))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(ConfigError::Invalid(format!(
            "--set {assignment:?}: empty key"
        )));
    }
    let parsed = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| Value::String(raw.to_string()));
    let mut cursor = value;
    let parts: Vec<&str> = key.split('.').collect();
    for part in &parts[..parts.len() - 1] {
        let table = cursor.as_table_mut().ok_or_else(|| {
            ConfigError::Invalid(format!("--set {key}: {part} is not inside a table"))
        })?;
        cursor = table
            .entry(part.to_string())
            .or_insert_with(|| Value::Table(Default::default()));
    }
    let last = parts[parts.len() - 1];
    let table = cursor
        .as_table_mut()
        .ok_or_else(|| ConfigError::Invalid(format!("--set {key}: parent is not a table")))?;
    if last == "kind" && table.get("kind") != Some(&parsed) {
        // Switching optimizer: drop the old kind's hyper-parameters except the lr.
        table.retain(|k, _| k == "lr");
    }
    table.insert(last.to_string(), parsed);
    Ok(())
}

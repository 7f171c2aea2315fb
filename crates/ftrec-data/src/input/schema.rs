//! Delimited text described by a schema: which columns are the label, dense and sparse
//! features, the delimiter, the multi-hot separator and whether there is a header. The
//! Criteo format is one such schema ([`crate::criteo::schema`]).
//!
//! A schema file is TOML:
//! ```toml
//! delimiter = ","          # one byte; "\t" for tabs
//! header = true            # first line holds column names (checked against `name`)
//! multi_hot_separator = "|" # optional; splits a sparse field into several ids
//! [[columns]]
//! name = "click"
//! kind = "label"
//! [[columns]]
//! name = "price"
//! kind = "dense"
//! transform = "log1p"      # or "none" (default)
//! [[columns]]
//! name = "user"
//! kind = "sparse"
//! encoding = "hash"        # or "hex" (the value is a hexadecimal id, as in Criteo)
//! [[columns]]
//! name = "comment"
//! kind = "ignore"
//! ```

use std::path::Path;

use serde::Deserialize;

use crate::hashing::{MISSING, raw, raw_from_token};
use crate::record::log1p_clamped;
use crate::{DataError, Record};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum DenseTransform {
    /// `log(1 + max(x, 0))`, Criteo's transform for count features.
    Log1p,
    #[default]
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SparseEncoding {
    /// Any token, hashed to 32 bits.
    #[default]
    Hash,
    /// A hexadecimal id of at most 8 digits, used as the raw value.
    Hex,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ColumnKind {
    Label,
    Dense { transform: DenseTransform },
    Sparse { encoding: SparseEncoding },
    Ignore,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Column {
    pub name: String,
    pub kind: ColumnKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum KindName {
    Label,
    Dense,
    Sparse,
    Ignore,
}

/// A column as written in the file; checked into a [`Column`] so that, say, a
/// `transform` on a sparse column is reported rather than ignored.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ColumnFile {
    name: String,
    kind: KindName,
    transform: Option<DenseTransform>,
    encoding: Option<SparseEncoding>,
}

impl ColumnFile {
    fn check(self, index: usize) -> Result<Column, String> {
        let misplaced = |key: &str| {
            Err(format!(
                "columns[{index}] ({}): `{key}` does not apply to a {:?} column",
                self.name, self.kind
            ))
        };
        let kind = match self.kind {
            KindName::Label | KindName::Ignore if self.transform.is_some() => {
                return misplaced("transform");
            }
            KindName::Label | KindName::Ignore | KindName::Dense if self.encoding.is_some() => {
                return misplaced("encoding");
            }
            KindName::Sparse if self.transform.is_some() => return misplaced("transform"),
            KindName::Label => ColumnKind::Label,
            KindName::Ignore => ColumnKind::Ignore,
            KindName::Dense => ColumnKind::Dense {
                transform: self.transform.unwrap_or_default(),
            },
            KindName::Sparse => ColumnKind::Sparse {
                encoding: self.encoding.unwrap_or_default(),
            },
        };
        Ok(Column {
            name: self.name,
            kind,
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SchemaFile {
    delimiter: String,
    #[serde(default)]
    header: bool,
    multi_hot_separator: Option<String>,
    columns: Vec<ColumnFile>,
}

/// A validated schema.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schema {
    pub delimiter: u8,
    pub header: bool,
    pub multi_hot_separator: Option<u8>,
    pub columns: Vec<Column>,
}

fn one_byte(field: &str, value: &str) -> Result<u8, String> {
    match value.as_bytes() {
        [b] => Ok(*b),
        _ => Err(format!("{field} must be exactly one byte, got {value:?}")),
    }
}

impl Schema {
    pub fn load(path: &Path) -> Result<Self, DataError> {
        let text = std::fs::read_to_string(path).map_err(|e| DataError::io(path, e))?;
        Self::parse(&text).map_err(|message| DataError::Schema {
            path: path.to_path_buf(),
            message,
        })
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        let file: SchemaFile = toml::from_str(text).map_err(|e| e.to_string())?;
        let schema = Schema {
            delimiter: one_byte("delimiter", &file.delimiter)?,
            header: file.header,
            multi_hot_separator: file
                .multi_hot_separator
                .as_deref()
                .map(|s| one_byte("multi_hot_separator", s))
                .transpose()?,
            columns: file
                .columns
                .into_iter()
                .enumerate()
                .map(|(i, c)| c.check(i))
                .collect::<Result<_, _>>()?,
        };
        schema.validate()?;
        Ok(schema)
    }

    pub fn validate(&self) -> Result<(), String> {
        let labels = self
            .columns
            .iter()
            .filter(|c| c.kind == ColumnKind::Label)
            .count();
        if labels != 1 {
            return Err(format!(
                "columns: exactly one label column is required, found {labels}"
            ));
        }
        if self.num_dense() == 0 || self.num_sparse() == 0 {
            return Err("columns: at least one dense and one sparse column are required".into());
        }
        if Some(self.delimiter) == self.multi_hot_separator {
            return Err("multi_hot_separator must differ from delimiter".into());
        }
        Ok(())
    }

    pub fn num_dense(&self) -> usize {
        self.columns
            .iter()
            .filter(|c| matches!(c.kind, ColumnKind::Dense { .. }))
            .count()
    }

    pub fn num_sparse(&self) -> usize {
        self.columns
            .iter()
            .filter(|c| matches!(c.kind, ColumnKind::Sparse { .. }))
            .count()
    }

    /// Checks a header line against the column names.
    pub fn check_header(&self, line: &[u8]) -> Result<(), String> {
        let names: Vec<&[u8]> = line.split(|&b| b == self.delimiter).collect();
        if names.len() != self.columns.len() {
            return Err(format!(
                "header has {} columns, schema has {}",
                names.len(),
                self.columns.len()
            ));
        }
        for (i, (got, col)) in names.iter().zip(&self.columns).enumerate() {
            if got.trim_ascii() != col.name.as_bytes() {
                return Err(format!(
                    "header column {} is {:?}, schema says {:?}",
                    i + 1,
                    String::from_utf8_lossy(got),
                    col.name
                ));
            }
        }
        Ok(())
    }

    /// Parses one line (without its newline) into `rec`. Errors name the column.
    pub fn parse_line(&self, line: &[u8], rec: &mut Record) -> Result<(), String> {
        rec.clear();
        let mut fields = line.split(|&b| b == self.delimiter);
        let mut count = 0;
        for col in &self.columns {
            count += 1;
            let Some(field) = fields.next() else {
                return Err(format!(
                    "expected {} fields, found {}",
                    self.columns.len(),
                    count - 1
                ));
            };
            let ctx = |m: String| format!("field {count} ({}): {m}", col.name);
            match col.kind {
                ColumnKind::Label => rec.label = parse_label(field).map_err(ctx)?,
                ColumnKind::Dense { transform } => {
                    let x = parse_number(field).map_err(ctx)?;
                    rec.dense.push(match transform {
                        DenseTransform::Log1p => log1p_clamped(x),
                        DenseTransform::None => x as f32,
                    });
                }
                ColumnKind::Sparse { encoding } => {
                    let sep = self.multi_hot_separator;
                    if field.is_empty() {
                        rec.ids.push(MISSING);
                    } else if let Some(sep) = sep {
                        for token in field.split(|&b| b == sep) {
                            rec.ids.push(parse_id(token, encoding).map_err(ctx)?);
                        }
                    } else {
                        rec.ids.push(parse_id(field, encoding).map_err(ctx)?);
                    }
                    rec.end_feature();
                }
                ColumnKind::Ignore => {}
            }
        }
        let extra = fields.count();
        if extra > 0 {
            return Err(format!(
                "expected {} fields, found {}",
                self.columns.len(),
                self.columns.len() + extra
            ));
        }
        Ok(())
    }
}

fn text(field: &[u8]) -> String {
    String::from_utf8_lossy(field).into_owned()
}

fn parse_label(field: &[u8]) -> Result<f32, String> {
    match field.trim_ascii() {
        b"0" => Ok(0.0),
        b"1" => Ok(1.0),
        other => Err(format!("label must be 0 or 1, got {:?}", text(other))),
    }
}

/// A missing (empty) dense value is 0; integers (also negative) and decimals are accepted.
fn parse_number(field: &[u8]) -> Result<f64, String> {
    let f = field.trim_ascii();
    if f.is_empty() {
        return Ok(0.0);
    }
    let s = std::str::from_utf8(f).map_err(|_| format!("not UTF-8: {:?}", text(f)))?;
    if let Ok(i) = s.parse::<i64>() {
        return Ok(i as f64);
    }
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() => Ok(x),
        _ => Err(format!("invalid number {s:?}")),
    }
}

fn parse_id(token: &[u8], encoding: SparseEncoding) -> Result<u32, String> {
    if token.is_empty() {
        return Ok(MISSING);
    }
    match encoding {
        SparseEncoding::Hash => Ok(raw_from_token(token)),
        SparseEncoding::Hex => {
            if token.len() > 8 {
                return Err(format!("hex id longer than 8 digits: {:?}", text(token)));
            }
            let mut v: u32 = 0;
            for &b in token {
                let d = (b as char)
                    .to_digit(16)
                    .ok_or_else(|| format!("invalid hex id {:?}", text(token)))?;
                v = (v << 4) | d;
            }
            Ok(raw(v))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCHEMA: &str = r#"
delimiter = ","
header = true
multi_hot_separator = "|"
[[columns]]
name = "y"
kind = "label"
[[columns]]
name = "age"
kind = "dense"
[[columns]]
name = "clicks"
kind = "dense"
transform = "log1p"
[[columns]]
name = "skip"
kind = "ignore"
[[columns]]
name = "tags"
kind = "sparse"
[[columns]]
name = "shop"
kind = "sparse"
encoding = "hex"
"#;

    #[test]
    fn parses_multi_hot_missing_and_negative_values() {
        let s = Schema::parse(SCHEMA).unwrap();
        s.check_header(b"y,age,clicks,skip,tags,shop").unwrap();
        assert!(
            s.check_header(b"y,age,clicks,skip,tag,shop")
                .unwrap_err()
                .contains("column 5")
        );
        let mut r = Record::default();
        s.parse_line(b"1,-2.5,-7,whatever,a|b|a,ff", &mut r)
            .unwrap();
        assert_eq!(r.label, 1.0);
        assert_eq!(r.dense, vec![-2.5, 0.0]);
        assert_eq!(r.feature(0).len(), 3);
        assert_eq!(r.feature(0)[0], r.feature(0)[2]);
        assert_ne!(r.feature(0)[0], r.feature(0)[1]);
        assert_eq!(r.feature(1), &[0xff]);
        s.parse_line(b"0,,3,,,", &mut r).unwrap();
        assert_eq!(r.dense, vec![0.0, (4.0f64).ln() as f32]);
        assert_eq!(r.feature(0), &[MISSING]);
        assert_eq!(r.feature(1), &[MISSING]);
    }

    #[test]
    fn malformed_lines_name_the_field() {
        let s = Schema::parse(SCHEMA).unwrap();
        let mut r = Record::default();
        let e = s.parse_line(b"2,1,1,x,a,ff", &mut r).unwrap_err();
        assert!(e.contains("field 1 (y)") && e.contains("0 or 1"), "{e}");
        let e = s.parse_line(b"1,abc,1,x,a,ff", &mut r).unwrap_err();
        assert!(e.contains("field 2 (age)") && e.contains("abc"), "{e}");
        let e = s.parse_line(b"1,1,1,x,a,zz", &mut r).unwrap_err();
        assert!(e.contains("field 6 (shop)"), "{e}");
        let e = s.parse_line(b"1,1,1,x,a", &mut r).unwrap_err();
        assert!(e.contains("expected 6 fields, found 5"), "{e}");
        let e = s.parse_line(b"1,1,1,x,a,1,9", &mut r).unwrap_err();
        assert!(e.contains("found 7"), "{e}");
    }

    #[test]
    fn invalid_schemas_are_explained() {
        let e = Schema::parse("delimiter = \"ab\"\ncolumns = []").unwrap_err();
        assert!(e.contains("delimiter"), "{e}");
        let e = Schema::parse("delimiter = \",\"\n[[columns]]\nname = \"a\"\nkind = \"dense\"\n")
            .unwrap_err();
        assert!(e.contains("label"), "{e}");
        let e = Schema::parse("delimiter = \",\"\n[[columns]]\nname = \"a\"\nkind = \"weird\"\n")
            .unwrap_err();
        assert!(e.contains("weird") || e.contains("unknown variant"), "{e}");
    }
}

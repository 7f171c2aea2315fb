//! Streaming reader for delimited text files, with precise error locations.

use std::io::BufRead;
use std::path::Path;

use crate::compressed::open_text;
use crate::schema::Schema;
use crate::{DataError, Record};

/// What a pass over a text file saw.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TextSummary {
    pub lines: u64,
    pub records: u64,
    pub bad_lines: u64,
    /// The first skipped line's error, so a user can see what was wrong.
    pub first_bad: Option<String>,
}

/// Calls `on_record` for every line of `path` (plain, gzip or zstd) parsed with `schema`. A malformed line is an
/// error naming the file and 1-based line number, unless `skip_bad_lines` is set, in
/// which case it is counted and skipped.
pub fn for_each_record(
    path: &Path,
    schema: &Schema,
    skip_bad_lines: bool,
    mut on_record: impl FnMut(&Record) -> Result<(), DataError>,
) -> Result<TextSummary, DataError> {
    let mut reader = open_text(path)?;
    let mut line = Vec::with_capacity(4096);
    let mut rec = Record::default();
    let mut summary = TextSummary::default();
    loop {
        line.clear();
        let n = reader
            .read_until(b'\n', &mut line)
            .map_err(|e| DataError::io(path, e))?;
        if n == 0 {
            break;
        }
        summary.lines += 1;
        while matches!(line.last(), Some(b'\n' | b'\r')) {
            line.pop();
        }
        if summary.lines == 1 && schema.header {
            schema
                .check_header(&line)
                .map_err(|message| DataError::Parse {
                    path: path.to_path_buf(),
                    line: 1,
                    message,
                })?;
            continue;
        }
        match schema
            .parse_line(&line, &mut rec)
            .map_err(|m| shorten(m, MAX_MESSAGE))
        {
            Ok(()) => {
                summary.records += 1;
                on_record(&rec)?;
            }
            Err(message) if skip_bad_lines => {
                summary.bad_lines += 1;
                if summary.first_bad.is_none() {
                    summary.first_bad =
                        Some(format!("{}:{}: {message}", path.display(), summary.lines));
                }
            }
            Err(message) => {
                return Err(DataError::Parse {
                    path: path.to_path_buf(),
                    line: summary.lines,
                    message,
                });
            }
        }
    }
    Ok(summary)
}

/// Errors quote the offending text; a huge line is cut, not echoed whole.
const MAX_MESSAGE: usize = 300;

fn shorten(message: String, max: usize) -> String {
    if message.len() <= max {
        return message;
    }
    let mut end = max;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes in all)", &message[..end], message.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::criteo;
    use std::fs::File;
    use std::io::Write;

    #[test]
    fn error_names_file_and_line_and_skip_counts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("day_0");
        let good = format!("1{}{}", "\t5".repeat(13), "\tabc".repeat(26));
        let mut f = File::create(&path).unwrap();
        writeln!(f, "{good}").unwrap();
        writeln!(f, "{good}").unwrap();
        writeln!(f, "1\tbroken").unwrap();
        write!(f, "{good}\r\n{good}").unwrap();
        drop(f);
        let s = criteo::schema();
        let err = for_each_record(&path, &s, false, |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("day_0:3:"), "{err}");
        let mut n = 0;
        let sum = for_each_record(&path, &s, true, |_| {
            n += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!((sum.lines, sum.records, sum.bad_lines, n), (5, 4, 1, 4));
        assert!(sum.first_bad.unwrap().contains("day_0:3"));
    }

    #[test]
    fn a_huge_bad_value_is_quoted_cut_not_whole() {
        let long = "x".repeat(50_000);
        let cut = shorten(format!("bad value {long:?}"), MAX_MESSAGE);
        assert!(
            cut.len() < 400 && cut.contains("bytes in all"),
            "{}",
            cut.len()
        );
        // Never inside a multi-byte character.
        let wide = "é".repeat(1000);
        assert!(shorten(wide, 301).ends_with("bytes in all)"));
        assert_eq!(shorten("short".into(), MAX_MESSAGE), "short");
    }
}

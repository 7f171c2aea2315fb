//! Progress bars on stderr (hidden automatically when stderr is not a terminal).

use indicatif::{ProgressBar, ProgressStyle};

pub fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    let style = ProgressStyle::with_template(&format!(
        "{what} [{{elapsed_precise}}] {{wide_bar}} {{pos}}/{{len}} {{msg}}"
    ))
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    pb.set_style(style);
    pb
}

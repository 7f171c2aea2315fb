//! The shoot-out's table for a person: the rows BENCHMARKS.md quotes.

use serde_json::Value;

use super::strategies_of;

/// The table BENCHMARKS.md quotes, one block per rate, a line each.
pub fn table(summary: &Value) -> Vec<String> {
    let num = |v: &Value, digits: usize| {
        v.as_f64()
            .map_or("-".to_string(), |x| format!("{x:.digits$}"))
    };
    let mut lines = Vec::new();
    for rate in ["rare", "frequent"] {
        let r = &summary["by_rate"][rate];
        // Failures per round's schedule (a summary from before per-round schedules has
        // one).
        let per_round: Vec<String> = match r["schedules"].as_array() {
            Some(list) => list
                .iter()
                .map(|s| s["failures"].as_array().map_or(0, Vec::len).to_string())
                .collect(),
            None => vec![
                r["schedule"]["failures"]
                    .as_array()
                    .map_or(0, Vec::len)
                    .to_string(),
            ],
        };
        lines.push(format!(
            "{rate}: MTBF {} s, {} failures; failure-free AUC {}; auto chose {}",
            num(&r["mtbf_seconds"], 1),
            per_round.join(" / "),
            num(&r["failure_free_auc"], 4),
            r["auto_choice"]["strategy"].as_str().unwrap_or("-")
        ));
        lines.push(
            "| strategy | ETT | AUC | logloss | lost samples | MB written | peak RSS MB | resume s | full redundancy s |"
                .to_string(),
        );
        lines.push("|---|---|---|---|---|---|---|---|---|".to_string());
        for s in strategies_of(summary) {
            let v = &r["strategies"][&s];
            let mb = |k: &str| {
                v[k].as_f64()
                    .map_or("-".into(), |x| format!("{:.0}", x / 1e6))
            };
            lines.push(format!(
                "| {s} | {} | {} | {} | {} | {} | {} | {} | {} |",
                num(&v["ett"], 3),
                num(&v["auc"], 4),
                num(&v["logloss"], 4),
                num(&v["lost_samples"], 0),
                mb("bytes_written"),
                mb("peak_rss_bytes"),
                num(&v["resume_seconds"], 2),
                num(&v["full_redundancy_seconds"], 2)
            ));
        }
        let auto = &r["strategies"]["auto"];
        if auto["choosing_seconds"].is_number() {
            lines.push(format!(
                "auto: {} s choosing counted in its ETT (median); {} if every run paid the \
                 whole calibration",
                num(&auto["choosing_seconds"], 1),
                num(&auto["ett_first_run"], 3)
            ));
        }
    }
    let capped = &summary["capped"];
    if capped["auto_choice"].is_object() {
        lines.push(format!(
            "capped ({} rate, cluster.server_memory_bytes = {:.0} MB against {:.0} MB under \
             ec): auto chose {} (ETT {}, AUC {}): {}",
            capped["rate"].as_str().unwrap_or("-"),
            capped["server_memory_bytes"].as_f64().unwrap_or(0.0) / 1e6,
            capped["server_need_ec_bytes"].as_f64().unwrap_or(0.0) / 1e6,
            capped["auto_choice"]["strategy"].as_str().unwrap_or("-"),
            num(&capped["figures"]["ett"], 3),
            num(&capped["figures"]["auc"], 4),
            capped["auto_choice"]["why"].as_str().unwrap_or("-"),
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_strategies_chosen_are_checked_and_tabled_in_their_order() {
        use super::super::{QUANTIZED_STRATEGIES, STRATEGIES, chosen_strategies};
        assert_eq!(chosen_strategies(&[]).unwrap().len(), STRATEGIES.len());
        let two = vec!["checkpoint-incrcp-int8".to_string(), "ec".to_string()];
        assert_eq!(chosen_strategies(&two).unwrap(), two);
        let e = chosen_strategies(&["int8".to_string()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"int8\"") && e.contains(QUANTIZED_STRATEGIES[0]),
            "{e}"
        );
        let lines = table(&json!({ "strategies": two }));
        assert_eq!(lines.len(), 2 * (3 + 2));
        assert!(
            lines[3].starts_with("| checkpoint-incrcp-int8 |"),
            "{}",
            lines[3]
        );
        assert!(lines[4].starts_with("| ec |"), "{}", lines[4]);
    }

    #[test]
    fn an_empty_summary_prints_dashes_not_a_panic() {
        let lines = table(&json!({}));
        // Per rate: the heading, the table's two header lines and a row per strategy.
        assert_eq!(lines.len(), 2 * (3 + super::super::STRATEGIES.len()));
        assert_eq!(
            lines[0],
            "rare: MTBF - s, 0 failures; failure-free AUC -; auto chose -"
        );
        assert_eq!(lines[3], "| none | - | - | - | - | - | - | - | - |");
    }

    #[test]
    fn figures_are_rounded_and_bytes_in_megabytes() {
        let summary = json!({ "by_rate": { "rare": {
            "mtbf_seconds": 12.34, "schedule": { "failures": [{}, {}] },
            "failure_free_auc": 0.712345, "auto_choice": { "strategy": "ec" },
            "strategies": { "ec": { "ett": 0.91234, "bytes_written": 2.4e6,
                                     "resume_seconds": 1.004, "lost_samples": 0 } },
        } } });
        let lines = table(&summary);
        assert_eq!(
            lines[0],
            "rare: MTBF 12.3 s, 2 failures; failure-free AUC 0.7123; auto chose ec"
        );
        let ec = lines
            .iter()
            .find(|l| l.starts_with("| ec |"))
            .map(String::as_str);
        assert_eq!(ec, Some("| ec | 0.912 | - | - | 0 | 2 | - | 1.00 | - |"));
    }

    #[test]
    fn autos_choosing_and_the_capped_case_get_a_line_each() {
        let summary = json!({
            "strategies": ["auto"],
            "by_rate": { "rare": { "strategies": { "auto": {
                "ett": 0.8, "choosing_seconds": 12.04, "ett_first_run": 0.61,
            } } } },
            "capped": {
                "rate": "frequent", "server_memory_bytes": 2.5e8, "server_need_ec_bytes": 3e8,
                "auto_choice": { "strategy": "checkpoint", "why": "ec is out" },
                "figures": { "ett": 0.7, "auc": 0.8 },
            },
        });
        let lines = table(&summary);
        assert!(
            lines.contains(
                &"auto: 12.0 s choosing counted in its ETT (median); 0.610 if every \
                run paid the whole calibration"
                    .to_string()
            ),
            "{lines:?}"
        );
        assert_eq!(
            lines.last().map(String::as_str),
            Some(
                "capped (frequent rate, cluster.server_memory_bytes = 250 MB against 300 MB \
                under ec): auto chose checkpoint (ETT 0.700, AUC 0.8000): ec is out"
            )
        );
    }

    #[test]
    fn each_rounds_schedule_is_counted() {
        let summary = json!({ "by_rate": { "frequent": {
            "mtbf_seconds": 5.0, "schedule": { "failures": [{}, {}] },
            "schedules": [{ "failures": [{}, {}] }, { "failures": [{}, {}, {}] }],
        } } });
        let lines = table(&summary);
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("frequent: MTBF 5.0 s, 2 / 3 failures;")),
            "{lines:?}"
        );
    }
}

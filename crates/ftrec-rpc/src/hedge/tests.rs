//! The hedge's tests: copies' timing, budget and lossy members on paused time.

use super::*;
use tokio::time::Instant;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

async fn answer(after: Duration, value: Result<u32, &'static str>) -> Result<u32, &'static str> {
    tokio::time::sleep(after).await;
    value
}

#[tokio::test(start_paused = true)]
async fn a_fast_call_sends_no_copy() {
    let started = Instant::now();
    let a = first_answer(answer(ms(1), Ok(1)), Some((ms(4), answer(ms(1), Ok(2))))).await;
    assert_eq!((a.result, a.hedged), (Ok(1), false));
    assert_eq!(started.elapsed(), ms(1));
}

#[tokio::test(start_paused = true)]
async fn a_slow_call_is_overtaken_by_its_copy() {
    let started = Instant::now();
    // The first waits out a 12 ms loss probe; the copy, sent at 4 ms, takes 1 ms.
    let a = first_answer(answer(ms(12), Ok(1)), Some((ms(4), answer(ms(1), Ok(2))))).await;
    assert_eq!((a.result, a.hedged), (Ok(2), true));
    assert_eq!(started.elapsed(), ms(5));
    // The first still answers first if it is quicker than the copy.
    let started = Instant::now();
    let a = first_answer(answer(ms(6), Ok(1)), Some((ms(4), answer(ms(5), Ok(2))))).await;
    assert_eq!((a.result, a.hedged), (Ok(1), true));
    assert_eq!(started.elapsed(), ms(6));
}

#[tokio::test(start_paused = true)]
async fn a_failure_waits_for_the_other_answer() {
    // The copy fails at once (its connection refused): the first's answer still wins.
    let a = first_answer(
        answer(ms(10), Ok(1)),
        Some((ms(4), answer(ms(0), Err("refused")))),
    )
    .await;
    assert_eq!(a.result, Ok(1));
    // The first fails after the copy was sent: the copy's answer wins.
    let a = first_answer(
        answer(ms(6), Err("reset")),
        Some((ms(4), answer(ms(5), Ok(2)))),
    )
    .await;
    assert_eq!(a.result, Ok(2));
    // Both fail: the first call's error.
    let a = first_answer(
        answer(ms(6), Err("first")),
        Some((ms(4), answer(ms(5), Err("copy")))),
    )
    .await;
    assert_eq!(a.result, Err("first"));
    // Without a copy the call is the call.
    let a = first_answer(
        answer(ms(6), Err("only")),
        None::<(Duration, std::future::Ready<_>)>,
    )
    .await;
    assert_eq!((a.result, a.hedged), (Err("only"), false));
}

#[test]
fn a_call_is_hedged_at_a_multiple_of_its_members_fast_quartile_with_a_floor_and_a_limit() {
    let mut h = Hedger::new(Some(Hedge {
        multiple: 4,
        floor: ms(2),
    }));
    for _ in 0..HEDGE_MIN_SAMPLES - 1 {
        h.record("pull", 0, Some(ms(1)), false);
    }
    assert_eq!(h.after("pull", 0, ms(250)), None, "too few samples");
    h.record("pull", 0, Some(ms(1)), false);
    assert_eq!(h.after("pull", 0, ms(250)), Some(ms(4)));
    // Each member by itself: another server's calls say nothing of this one's.
    assert_eq!(h.after("pull", 1, ms(250)), None);
    // Two calls in five slowed by a 12 ms loss probe (a lossy link's bulk prepares)
    // leave the trigger where the loss-free calls put it.
    for i in 0..WINDOW {
        h.record("push", 0, Some(ms(if i % 5 < 2 { 12 } else { 3 })), false);
    }
    assert_eq!(h.trigger_at("push", 0), Some(ms(12)));
    // Three in five: the median is the probe itself, and copies on it would go out no
    // sooner than the probe; the fast quartile still stands for the loss-free calls.
    for i in 0..WINDOW {
        h.record("push", 2, Some(ms(if i % 5 < 3 { 12 } else { 3 })), false);
    }
    assert_eq!(h.times_at("push", 2, 50), Some(ms(12)), "the median moved");
    assert_eq!(
        h.trigger_at("push", 2),
        Some(ms(12)),
        "the quartile did not"
    );
    // A member slow for every call has a slow quartile, so its calls wait longer.
    for _ in 0..WINDOW {
        h.record("push", 1, Some(ms(30)), false);
    }
    assert_eq!(h.trigger_at("push", 1), Some(ms(120)));
    // The floor, for calls far quicker than a tick.
    for _ in 0..WINDOW {
        h.record("commit", 0, Some(Duration::from_micros(200)), false);
    }
    assert_eq!(h.after("commit", 0, ms(250)), Some(ms(2)));
    // Never at or past the limit, and never when hedging is off.
    assert_eq!(h.after("commit", 0, ms(2)), None);
    let mut off = Hedger::new(None);
    for _ in 0..WINDOW {
        off.record("pull", 0, Some(ms(1)), false);
    }
    assert_eq!(off.after("pull", 0, ms(250)), None);
}

#[test]
fn a_lossy_member_gets_its_copies_at_once_and_a_congested_or_starved_one_never() {
    let hedge = Hedge {
        multiple: 3,
        floor: ms(2),
    };
    let mut h = Hedger::new(Some(hedge));
    for m in 0..3 {
        for _ in 0..WINDOW {
            h.record("pull", m, Some(ms(1)), false);
        }
    }
    assert_eq!(h.trigger_at("pull", 0), Some(ms(3)));
    // None is late, so none gets a copy.
    assert_eq!(h.after("pull", 0, ms(250)), None);
    // One call in six to member 0 waits for a 12 ms probe, one in sixty to the others:
    // the eighth late one makes member 0 lossy.
    let mut calls = 0;
    while h.after("pull", 0, ms(250)) != Some(Duration::ZERO) {
        for m in 0..3 {
            let every = if m == 0 { 6 } else { 60 };
            let took = if calls % every == 0 { 12 } else { 1 };
            h.record("pull", m, Some(ms(took)), took > 3);
        }
        calls += 1;
        assert!(calls <= LOSSY_WINDOW, "never lossy");
    }
    assert!(calls > 40, "lossy after {calls} calls");
    assert_ne!(
        h.after("pull", 1, ms(250)),
        Some(Duration::ZERO),
        "the others are not"
    );
    // Its next calls go out with their copies at once, outside the budget, then it is
    // measured again.
    let spent = h.tracks[&("pull", 0)].credit;
    for _ in 0..EAGER_CALLS {
        assert_eq!(h.after("pull", 0, ms(250)), Some(Duration::ZERO));
        h.record("pull", 0, Some(ms(1)), true);
    }
    assert!(h.tracks[&("pull", 0)].credit >= spent);
    assert_eq!(h.after("pull", 0, ms(250)), None, "measured again");
    assert_eq!(h.trigger_at("pull", 0), Some(ms(3)));
    // A host short of CPU makes its calls to every member late alike: none is lossy.
    for i in 0..4 * WINDOW {
        for m in 0..3 {
            let took = if (i + m) % 5 == 0 { 12 } else { 1 };
            h.record("push", m, Some(ms(took)), false);
            assert_ne!(
                h.after("push", m, ms(250)),
                Some(Duration::ZERO),
                "call {i}"
            );
        }
    }
    // A link slow for every call, twice as slow now and then (congested, not
    // lossy), is never lossy either: its calls stay within a multiple of its own fast
    // quartile.
    for i in 0..4 * WINDOW {
        let took = if i % 4 == 0 { 60 } else { 30 };
        h.record("commit", 1, Some(ms(took)), false);
        h.record("commit", 0, Some(ms(1)), false);
        assert_ne!(
            h.after("commit", 1, ms(250)),
            Some(Duration::ZERO),
            "call {i}"
        );
    }
}

/// A server whose own link loses packets finds every peer late alike, as a host short
/// of CPU does: with nothing else to go on none is lossy. The kernel's count of the
/// link's retransmissions (`lost`) tells them apart, and then the late calls alone make
/// the peer lossy, and its copies go on at once while the link keeps losing.
#[test]
fn peers_behind_a_link_seen_losing_get_copies_at_once_though_none_leads() {
    let mut h = parity_calls_answered_in_1_ms(2);
    let late_alike = |h: &mut Hedger, lost: Option<bool>, calls: usize| {
        for i in 0..calls {
            for m in 0..2 {
                let took = if i % 6 == 0 { 12 } else { 1 };
                h.record_seen("parity", m, Some(ms(took)), false, lost);
            }
        }
    };
    late_alike(&mut h, None, 4 * LOSSY_WINDOW);
    assert_ne!(
        h.after_seen("parity", 0, ms(250), None),
        Some(Duration::ZERO),
        "late alike, unseen: not lossy"
    );
    late_alike(&mut h, Some(true), LOSSY_WINDOW);
    for m in 0..2 {
        assert_eq!(
            h.after_seen("parity", m, ms(250), Some(true)),
            Some(Duration::ZERO),
            "member {m}, seen losing"
        );
    }
    // Past one eager window, still seen losing: still at once.
    for _ in 0..2 * EAGER_CALLS {
        h.record_seen("parity", 0, Some(ms(1)), true, Some(true));
    }
    assert_eq!(
        h.after_seen("parity", 0, ms(250), Some(true)),
        Some(Duration::ZERO)
    );
    // The link clean again: no copy at all, and its eager window runs out.
    assert_eq!(h.after_seen("parity", 0, ms(250), Some(false)), None);
    for _ in 0..EAGER_CALLS {
        h.record_seen("parity", 0, Some(ms(1)), true, Some(false));
    }
    assert_ne!(
        h.after_seen("parity", 0, ms(250), None),
        Some(Duration::ZERO),
        "eager after the link was seen clean"
    );
}

/// A hedger (copies at 3 x the fast quartile) whose parity calls to each of `members`
/// were all answered in 1 ms.
fn parity_calls_answered_in_1_ms(members: usize) -> Hedger {
    let mut h = Hedger::new(Some(Hedge {
        multiple: 3,
        floor: ms(2),
    }));
    for m in 0..members {
        for _ in 0..WINDOW {
            h.record("parity", m, Some(ms(1)), false);
        }
    }
    h
}

/// Copies within the budget go to a member whose calls are late more often than the
/// others', never to members late alike (a host short of CPU).
#[test]
fn only_a_member_late_more_than_the_others_gets_copies() {
    let mut h = parity_calls_answered_in_1_ms(3);
    // Every member late one call in ten: no copy to any.
    for i in 0..2 * WINDOW {
        for m in 0..3 {
            let took = if (i + m) % 10 == 0 { 8 } else { 1 };
            assert_eq!(h.after("parity", m, ms(250)), None, "call {i} to {m}");
            h.record("parity", m, Some(ms(took)), false);
        }
    }
    // Member 1 late every other call, the others as before: member 1 gets copies once
    // its late calls are three times theirs; the others still none.
    let mut copied = 0;
    for i in 0..WINDOW {
        for m in 0..3 {
            let late = if m == 1 {
                i % 2 == 0
            } else {
                (i + m) % 10 == 0
            };
            let copy = h.after("parity", m, ms(250));
            if m != 1 {
                assert_eq!(copy, None, "call {i} to {m}");
            }
            copied += usize::from(m == 1 && copy.is_some());
            h.record(
                "parity",
                m,
                Some(ms(if late { 8 } else { 1 })),
                copy.is_some(),
            );
        }
    }
    assert!(copied > 0, "member 1 got no copy");
}

/// What the kernel says of the link decides first: no retransmission, no copy, however
/// late; a retransmission, copies within the budget without leading the others.
#[test]
fn a_link_seen_clean_gets_no_copy_and_one_seen_lossy_needs_no_lead() {
    let mut h = parity_calls_answered_in_1_ms(2);
    // Late alike: no lead, so copies only where the link is seen lossy.
    for i in 0..WINDOW {
        for m in 0..2 {
            h.record("parity", m, Some(ms(if i % 3 == 0 { 9 } else { 1 })), false);
        }
    }
    assert_eq!(h.after("parity", 0, ms(250)), None);
    assert_eq!(h.after_seen("parity", 0, ms(250), Some(false)), None);
    assert_eq!(h.after_seen("parity", 0, ms(250), Some(true)), Some(ms(3)));
    // Even a member taken for lossy by its lateness gets none on a link seen clean.
    h.tracks.entry(("parity", 1)).or_default().eager_left = 3;
    assert_eq!(
        h.after_seen("parity", 1, ms(250), None),
        Some(Duration::ZERO)
    );
    assert_eq!(h.after_seen("parity", 1, ms(250), Some(false)), None);
}

#[test]
fn copies_are_bounded_by_the_budget() {
    let mut h = Hedger::new(Some(Hedge {
        multiple: 4,
        floor: ms(2),
    }));
    for _ in 0..WINDOW {
        h.record("pull", 0, Some(ms(1)), false);
    }
    // Every call slow and sent twice: the burst, then one copy per five calls.
    let mut sent = 0;
    for _ in 0..1000 {
        let hedged = h.after("pull", 0, ms(250)).is_some();
        sent += usize::from(hedged);
        h.record("pull", 0, Some(ms(1)), hedged);
    }
    assert!((150..=215).contains(&sent), "{sent} copies for 1000 calls");
    assert_eq!(h.counts().total(), sent as u64);
    assert_eq!(h.counts().summary(), format!("pull {sent}"));
}

#[test]
fn counts_are_kept_by_kind() {
    let counts = HedgeCounts::default();
    assert_eq!(counts.summary(), "none");
    counts.add("pull");
    counts.add("prepare");
    counts.add("pull");
    assert_eq!(counts.summary(), "prepare 1, pull 2");
}

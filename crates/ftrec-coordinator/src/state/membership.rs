//! Who holds each slot: the servers, workers and spares that joined, each join an
//! incarnation of its slot; the zombies refused; and the evidence that a server is to be
//! declared dead although it still heartbeats (a refused probe, workers cut off from it).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use tokio::time::Instant;

use ftrec_proto::proto::Role;

#[derive(Clone, Debug, Default)]
pub(crate) struct Member {
    pub(crate) address: String,
    pub(crate) pid: u32,
    pub(crate) joined: bool,
    pub(crate) alive: bool,
    pub(crate) ready: bool,
    pub(crate) last_seen: Option<Instant>,
    /// A probe found nothing listening at its address: dead, without waiting for its
    /// heartbeats to time out.
    pub(crate) refused: bool,
    /// Which join of the slot this is (`JoinReply.incarnation`): an older process of the
    /// slot that comes back (a zombie) is told apart by it.
    pub(crate) incarnation: u64,
    /// Workers cannot reach it, though it answers the coordinator (a partition): why it is
    /// to be declared dead.
    pub(crate) cut_off: Option<String>,
}

impl Member {
    pub(crate) fn silent_for(&self) -> Duration {
        self.last_seen.map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// Silent past `timeout`, and the coordinator heard from someone else after that
    /// deadline (`heard`): the silence is this member's. A coordinator that hears nobody
    /// (its own link is down, or its links are held) would otherwise declare every member
    /// dead one after another (issue 42: found by the simulation, a leader cut off for
    /// 1.9 s replaced all three servers, and the job was lost).
    pub(crate) fn silent_on_its_own(&self, timeout: Duration, heard: Option<Instant>) -> bool {
        self.last_seen.is_some_and(|last| {
            last.elapsed() > timeout && heard.is_some_and(|heard| heard > last + timeout)
        })
    }

    /// A live member about to be declared dead: silent past `timeout`, or its port refused
    /// a connection.
    fn dying(&self, timeout: Duration) -> bool {
        self.joined && self.alive && (self.silent_for() > timeout || self.refused)
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Spare {
    pub(crate) token: u32,
    pub(crate) member: Member,
    pub(crate) assigned: Option<usize>,
    /// Started by this live server on its host while a lost slot waited
    /// (`JoinRequest.hosted_by`): its slot moves to a spare from elsewhere once one joins.
    pub(crate) hosted_by: Option<usize>,
    /// A record's free spare, not heard from since this leader took over: an earlier
    /// leader may have given it a slot without a record (through an etcd outage), so it
    /// gets none until it says which, if any, it serves.
    pub(crate) unheard: bool,
    /// The slot it serves by an earlier leader's unrecorded assignment, as its heartbeat
    /// says: it gets that slot back, and no other.
    pub(crate) claims: Option<usize>,
    /// Its peak resident set while it waited (`HeartbeatRequest.peak_rss_bytes`): what
    /// standing by costs, the pre-faulted reserve included. Kept after it takes a slot.
    pub(crate) waiting_peak_rss: u64,
}

/// Lost steps in a row, each because its worker could not reach the same server, after
/// which that server is declared dead even though it answers the coordinator: it is cut
/// off from the workers (a partition), and the job cannot train through it.
const UNREACHABLE_REPORTS: u32 = 2;

pub(crate) struct Membership {
    pub(crate) servers: Vec<Member>,
    pub(crate) spares: Vec<Spare>,
    pub(crate) workers: Vec<Member>,
    /// Incarnations of processes refused after being declared dead.
    pub(crate) zombies: BTreeSet<u64>,
    /// Incarnations of the servers of a layout the job moved off (`cluster scale`): told
    /// to stop.
    pub(crate) retired: BTreeSet<u64>,
    /// Lost steps in a row whose worker could not reach this server (reset by any step
    /// that finishes).
    pub(crate) unreachable_reports: BTreeMap<usize, u32>,
    /// The next join's incarnation (a spare's is also its token).
    pub(crate) next_token: u32,
    /// Replacements of each worker slot so far.
    pub(crate) worker_respawns: Vec<u32>,
    /// Per server process (incarnation): the RPCs it served and their payload bytes, as
    /// its latest heartbeat said.
    pub(crate) served: HashMap<u64, (u64, u64)>,
    /// A worker's call to a server failed: probe the servers' ports (`control.rs`).
    pub(crate) probe_requested: bool,
    /// Processes of each slot that exited before they joined, started again since.
    pub(crate) early_exits: BTreeMap<(Role, usize), u32>,
    /// Spares asked of survivors' hosts for a lost slot with no replacement.
    pub(crate) hosting: super::Hosting,
    /// After a takeover: until then no spare is given a slot while a record's free spare
    /// is unheard, but one that claims that slot. It may serve a slot by the old leader's
    /// unrecorded assignment, and a fresh spare given that slot first crossed them (a
    /// soak's quorum loss: the claimer fenced, a worker's calls to the slot lost for 7 s).
    pub(crate) claims_until: Option<Instant>,
    /// After a takeover: each slot's incarnation in the record. A claim for a slot whose
    /// process changed since (this leader gave it to another) is stale; the record's own
    /// holder of a slot, a spare listed as assigned to it, does not make a claim stale.
    pub(crate) recorded_incarnations: Vec<u64>,
    /// A takeover has not yet brought every live server into its epoch: a claimer heard
    /// meanwhile is installed in its slot with its shard, and fenced with the others.
    pub(crate) takeover_fencing: bool,
    /// After a takeover: the incarnations an earlier leader may have handed out through an
    /// etcd outage without a record (from the record's next token on). A process in a
    /// slot with one of them joined unrecorded; it may claim that slot as a record's free
    /// spare does (`spare_claims.rs`).
    pub(crate) unrecorded_incarnations: Option<std::ops::Range<u64>>,
    /// Slots a claimer was installed in during the takeover: the takeover checks that it
    /// applied every step the others did (a claimer that an earlier leader declared dead
    /// in turn would be behind them) before it counts.
    pub(crate) claimed: BTreeSet<usize>,
}

impl Membership {
    pub(crate) fn new(servers: usize, workers: usize) -> Self {
        Self {
            servers: vec![Member::default(); servers],
            spares: Vec::new(),
            workers: vec![Member::default(); workers],
            zombies: BTreeSet::new(),
            retired: BTreeSet::new(),
            unreachable_reports: BTreeMap::new(),
            next_token: 1,
            worker_respawns: vec![0; workers],
            served: HashMap::new(),
            early_exits: BTreeMap::new(),
            probe_requested: false,
            hosting: super::Hosting::default(),
            claims_until: None,
            recorded_incarnations: Vec::new(),
            takeover_fencing: false,
            unrecorded_incarnations: None,
            claimed: BTreeSet::new(),
        }
    }

    /// Retires every server of the current layout (their processes are told to stop) and
    /// opens `servers` empty slots for the next layout.
    pub(crate) fn retire_servers(&mut self, servers: usize) {
        let old = std::mem::replace(&mut self.servers, vec![Member::default(); servers]);
        self.retired
            .extend(old.iter().filter(|m| m.joined).map(|m| m.incarnation));
        self.unreachable_reports.clear();
        self.early_exits
            .retain(|(role, _), _| *role != Role::Server);
    }

    /// A new join's incarnation: never one given before (0 means "none" on the wire).
    pub(crate) fn next_incarnation(&mut self) -> u32 {
        let incarnation = self.next_token;
        self.next_token += 1;
        incarnation
    }

    /// The pid of the process that joined as `role` `id`, if any.
    pub(crate) fn pid_of(&self, role: Role, id: usize) -> Option<u32> {
        let m = match role {
            Role::Server => self.servers.get(id),
            Role::Worker => self.workers.get(id),
            Role::Unspecified => None,
        }?;
        (m.joined && m.pid != 0).then_some(m.pid)
    }

    /// The pids of the spares that wait for a slot (not yet given one).
    /// The largest peak a spare reported while it waited, taken slots' spares included
    /// (a spare given a slot before the launcher read its `/proc` was never measured).
    pub(crate) fn waiting_spare_peak(&self) -> Option<u64> {
        self.spares
            .iter()
            .map(|s| s.waiting_peak_rss)
            .filter(|&b| b > 0)
            .max()
    }

    pub(crate) fn waiting_spare_pids(&self) -> Vec<u32> {
        self.spares
            .iter()
            .filter(|s| s.assigned.is_none() && s.member.pid != 0)
            .map(|s| s.member.pid)
            .collect()
    }

    /// Gives server slot `id` to the first live spare that waits for one: the slot's member
    /// becomes the spare's process, not ready (it has no shard yet) and with a fresh
    /// failure timeout from `now`. Returns the spare's token and address.
    pub(crate) fn assign_spare(&mut self, id: usize, now: Instant) -> Option<(u32, String)> {
        // A spare that serves this slot by an earlier leader's unrecorded assignment gets
        // it back; one that serves another slot, or has not said, gets none (for
        // `claims_until` after a takeover, no spare does while one has not said). Then a
        // spare on a host of its own: one on a survivor's host doubles that host's load
        // and its loss costs two shards.
        let free = |sp: &Spare| {
            sp.assigned.is_none() && sp.member.alive && !sp.unheard && sp.claims.is_none()
        };
        let claimer = self
            .spares
            .iter()
            .position(|sp| sp.assigned.is_none() && sp.member.alive && sp.claims == Some(id));
        if claimer.is_none() && self.awaiting_claims(now) {
            return None;
        }
        let first_free = claimer
            .or_else(|| {
                self.spares
                    .iter()
                    .position(|sp| free(sp) && sp.hosted_by.is_none())
            })
            .or_else(|| self.spares.iter().position(free))?;
        let spare = &mut self.spares[first_free];
        spare.assigned = Some(id);
        let member = Member {
            ready: false,
            // A spare whose silence a takeover forgave keeps that grace in its slot: it
            // may not have found the new leader yet, and a slot does not make it hear
            // sooner. Counted from `now`, two live spares given the slot after a quorum
            // loss were declared dead one failure timeout later, and exited.
            last_seen: spare.member.last_seen.max(Some(now)),
            refused: false,
            cut_off: None,
            ..spare.member.clone()
        };
        let (token, address) = (spare.token, member.address.clone());
        *self.servers.get_mut(id)? = member;
        Some((token, address))
    }

    /// The live servers a probe is to reach, once per request.
    pub(crate) fn take_probe_targets(&mut self) -> Option<Vec<(usize, String)>> {
        if !std::mem::take(&mut self.probe_requested) {
            return None;
        }
        Some(
            self.servers
                .iter()
                .enumerate()
                .filter(|(_, m)| m.joined && m.alive && !m.address.is_empty())
                .map(|(id, m)| (id, m.address.clone()))
                .collect(),
        )
    }

    /// Every member seen before gets a fresh failure timeout from `now`: the silence was
    /// the coordinator's own (it did not run).
    pub(crate) fn forgive_silence(&mut self, now: Instant) {
        let members = self.servers.iter_mut().chain(self.workers.iter_mut());
        for m in members.chain(self.spares.iter_mut().map(|s| &mut s.member)) {
            if m.last_seen.is_some() {
                m.last_seen = Some(now);
            }
        }
    }

    /// A server that went silent or refused connections explains the steps lost meanwhile:
    /// "cut off" evidence gathered then against another server is void (a call relayed
    /// through the dying one failed, say), and if the partition is real the new epoch's
    /// reports show it again. Declaring both lost two servers of a group at once.
    pub(crate) fn void_cut_off_evidence(&mut self, timeout: Duration) {
        if !self.servers.iter().any(|m| m.dying(timeout)) {
            return;
        }
        for m in self.servers.iter_mut().filter(|m| !m.dying(timeout)) {
            m.cut_off = None;
        }
        self.unreachable_reports.clear();
    }

    /// The last time any member was heard (`None` before the first).
    pub(crate) fn last_heard(&self) -> Option<Instant> {
        let spares = self.spares.iter().map(|s| &s.member);
        self.servers
            .iter()
            .chain(&self.workers)
            .chain(spares)
            .filter_map(|m| m.last_seen)
            .max()
    }

    /// Why server `id` is to be declared dead now, if it is. `heard`: the coordinator's
    /// last sign that its own links work ([`Member::silent_on_its_own`]).
    pub(crate) fn server_failure(
        &self,
        id: usize,
        timeout: Duration,
        heard: Option<Instant>,
    ) -> Option<String> {
        let m = self.servers.get(id)?;
        let silent = m.silent_for();
        let silenced = m.silent_on_its_own(timeout, heard);
        if !(m.joined && m.alive && (silenced || m.refused || m.cut_off.is_some())) {
            return None;
        }
        if self.claim_awaited(id, Instant::now()) {
            return None;
        }
        Some(if let Some(why) = &m.cut_off {
            why.clone()
        } else if m.refused {
            refused_port(silent)
        } else {
            format!("silent for {silent:?}")
        })
    }

    /// Why server `id` is dead on hard evidence alone, its port refusing a connection (no
    /// process listens there, whoever leads), or None: what a leader whose lease is in
    /// doubt may still act on, where silence may be its own partition.
    pub(crate) fn server_refused(&self, id: usize) -> Option<String> {
        let m = self.servers.get(id)?;
        if self.claim_awaited(id, Instant::now()) {
            return None;
        }
        (m.joined && m.alive && m.refused).then(|| refused_port(m.silent_for()))
    }

    /// For `claims_until` after a takeover, while a record's free spare is unheard, the
    /// record's process of slot `id` is not declared dead: an earlier leader may have
    /// given the slot to that spare (it declared the process dead first, unrecorded), and
    /// the spare's claim keeps the slot's shard. Declared before the claim came, the slot
    /// was rebuilt from the survivors onto the very spare that held it.
    fn claim_awaited(&self, id: usize, now: Instant) -> bool {
        self.awaiting_claims(now)
            && self.recorded_incarnations.get(id) == self.servers.get(id).map(|m| &m.incarnation)
    }

    /// Within `claims_until` after a takeover, a live free spare of the record has not yet
    /// said which slot, if any, it serves.
    fn awaiting_claims(&self, now: Instant) -> bool {
        self.claims_until.is_some_and(|t| now < t)
            && self.spares.iter().any(|sp| sp.unheard && sp.member.alive)
    }

    /// Worker `worker` lost a step because it could not reach `server`: after
    /// `UNREACHABLE_REPORTS` such losses in a row the server is marked cut off (declared
    /// dead by the failure detector), and its count starts over. One report is enough when
    /// the worker `confirmed` it: a connection of its own got no answer either, so the
    /// server is not merely slow, and the coordinator, which still hears it, sees a
    /// partition whose server side must go (workers are cheap to route around).
    pub(crate) fn report_unreachable(
        &mut self,
        server: usize,
        worker: usize,
        reason: &str,
        confirmed: bool,
    ) {
        let count = self.unreachable_reports.entry(server).or_default();
        *count += 1;
        let count = *count;
        if count < UNREACHABLE_REPORTS && !confirmed {
            return;
        }
        if let Some(m) = self.servers.get_mut(server)
            && m.alive
            && m.cut_off.is_none()
        {
            m.cut_off = Some(if confirmed {
                format!(
                    "is cut off from worker {worker}: a step was lost because its calls got no \
                     answer, and neither did a connection of the worker's own ({reason}), \
                     though it answers the coordinator"
                )
            } else {
                format!(
                    "is cut off from the workers: {count} steps in a row lost because worker \
                     {worker}'s calls could not reach it, directly or through another server \
                     ({reason}), though it answers the coordinator"
                )
            });
            self.unreachable_reports.remove(&server);
        }
    }

    /// Worker `id` was declared dead: counts its replacement. Returns how many the slot
    /// has had, this one included.
    pub(crate) fn worker_respawned(&mut self, id: usize) -> u32 {
        match self.worker_respawns.get_mut(id) {
            Some(n) => {
                *n += 1;
                *n
            }
            None => 0,
        }
    }

    /// The slots with no live process joined (none yet, or a replacement awaited),
    /// servers first.
    pub(crate) fn without_process(&self) -> Vec<(Role, usize)> {
        let servers = self
            .servers
            .iter()
            .enumerate()
            .map(|(id, m)| (Role::Server, id, m));
        let workers = self
            .workers
            .iter()
            .enumerate()
            .map(|(id, m)| (Role::Worker, id, m));
        servers
            .chain(workers)
            .filter(|(_, _, m)| !(m.joined && m.alive))
            .map(|(role, id, _)| (role, id))
            .collect()
    }

    /// Slot (`role`, `id`)'s process exited before it joined: counts it. Returns how many
    /// have, the slot's first process included.
    pub(crate) fn exited_before_joining(&mut self, role: Role, id: usize) -> u32 {
        let n = self.early_exits.entry((role, id)).or_default();
        *n += 1;
        *n
    }

    /// Every server is up with its shard, and every worker has joined: training may start.
    pub(crate) fn all_joined(&self) -> bool {
        self.servers_ready() && self.workers.iter().all(|m| m.joined)
    }

    /// Every server slot holds a live process ready to serve.
    pub(crate) fn servers_ready(&self) -> bool {
        self.servers.iter().all(|m| m.alive && m.ready)
    }
}

fn refused_port(silent: Duration) -> String {
    format!("its port refused a connection after a call to it failed (silent for {silent:?})")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(address: &str, pid: u32) -> Member {
        Member {
            address: address.into(),
            pid,
            joined: true,
            alive: true,
            ready: true,
            last_seen: Some(Instant::now()),
            ..Member::default()
        }
    }

    fn with_spares(alive: &[bool]) -> Membership {
        let mut m = Membership::new(3, 1);
        for (k, &a) in alive.iter().enumerate() {
            let token = m.next_incarnation();
            m.spares.push(Spare {
                token,
                member: Member {
                    alive: a,
                    ..live(&format!("spare{k}:1"), 100 + k as u32)
                },
                assigned: None,
                hosted_by: None,
                unheard: false,
                claims: None,
                waiting_peak_rss: 0,
            });
        }
        m
    }

    #[test]
    fn a_spare_takes_one_slot_and_only_a_live_one_is_given() {
        let mut m = with_spares(&[false, true, true]);
        let now = Instant::now();
        // The dead spare is skipped; the first live one takes slot 2, not ready yet.
        assert_eq!(m.assign_spare(2, now), Some((2, "spare1:1".into())));
        assert_eq!(m.servers[2].address, "spare1:1");
        assert!(!m.servers[2].ready && m.servers[2].alive);
        // It is not given again: the next slot gets the other one, then none is left.
        assert_eq!(m.assign_spare(0, now), Some((3, "spare2:1".into())));
        assert_eq!(m.assign_spare(1, now), None);
        assert_eq!(m.spares[1].assigned, Some(2));
        assert!(m.waiting_spare_pids().contains(&100));
        assert!(!m.waiting_spare_pids().contains(&101));
    }

    #[test]
    fn a_spare_forgiven_by_a_takeover_keeps_its_grace_in_the_slot_it_is_given() {
        let mut m = with_spares(&[true, true]);
        let now = Instant::now();
        let timeout = Duration::from_secs(1);
        // A takeover forgives every member's silence until a TTL and a request from now.
        let grace_until = now + Duration::from_secs(6);
        m.forgive_silence(grace_until);
        m.assign_spare(1, now);
        assert_eq!(m.servers[1].last_seen, Some(grace_until));
        assert!(!m.servers[1].dying(timeout));
        // Without a grace the slot counts from the assignment.
        let later = now + Duration::from_secs(7);
        m.assign_spare(2, later);
        assert_eq!(m.servers[2].last_seen, Some(later));
    }

    #[test]
    fn incarnations_are_never_reused() {
        let mut m = Membership::new(1, 1);
        let a = m.next_incarnation();
        let b = m.next_incarnation();
        assert!(a > 0 && b > a);
    }

    #[test]
    fn two_unreachable_reports_in_a_row_cut_a_live_server_off() {
        let mut m = Membership::new(2, 1);
        m.servers[1] = live("s1:1", 7);
        m.report_unreachable(1, 0, "timeout", false);
        assert!(m.servers[1].cut_off.is_none());
        m.report_unreachable(1, 0, "timeout", false);
        assert!(m.servers[1].cut_off.is_some());
        assert!(m.server_failure(1, Duration::from_secs(60), None).is_some());
        // Its count started over.
        assert!(!m.unreachable_reports.contains_key(&1));
        // A dead server is not marked: the detector has dealt with it.
        m.servers[0] = Member {
            alive: false,
            ..live("s0:1", 8)
        };
        m.report_unreachable(0, 0, "timeout", false);
        m.report_unreachable(0, 0, "timeout", false);
        assert!(m.servers[0].cut_off.is_none());
    }

    #[test]
    fn one_confirmed_report_cuts_a_live_server_off() {
        let mut m = Membership::new(2, 1);
        m.servers[1] = live("s1:1", 7);
        m.report_unreachable(1, 0, "no answer; the probe got none", true);
        let why = m.servers[1].cut_off.clone().unwrap();
        assert!(why.contains("cut off from worker 0"), "{why}");
        assert!(m.server_failure(1, Duration::from_secs(60), None).is_some());
    }

    #[test]
    fn a_dying_server_voids_the_cut_off_evidence_against_the_others() {
        let mut m = Membership::new(2, 1);
        m.servers[0] = live("s0:1", 7);
        m.servers[1] = live("s1:1", 8);
        m.servers[1].cut_off = Some("cut off".into());
        m.unreachable_reports.insert(1, 1);
        let timeout = Duration::from_secs(60);
        // Nobody dying: the evidence stands.
        m.void_cut_off_evidence(timeout);
        assert!(m.servers[1].cut_off.is_some());
        m.servers[0].refused = true;
        m.void_cut_off_evidence(timeout);
        assert!(m.servers[1].cut_off.is_none());
        assert!(m.unreachable_reports.is_empty());
        assert!(
            m.server_failure(0, timeout, None)
                .is_some_and(|w| w.contains("refused"))
        );
        assert_eq!(m.server_failure(1, timeout, None), None);
    }

    #[test]
    fn forgiving_a_stall_refreshes_only_members_seen_before() {
        let mut m = with_spares(&[true]);
        let long_ago = Instant::now() - Duration::from_secs(30);
        m.servers[0] = Member {
            last_seen: Some(long_ago),
            ..live("s0:1", 7)
        };
        m.spares[0].member.last_seen = Some(long_ago);
        m.forgive_silence(Instant::now());
        assert!(m.servers[0].silent_for() < Duration::from_secs(1));
        assert!(m.spares[0].member.silent_for() < Duration::from_secs(1));
        // Never seen: still never seen (it has not joined).
        assert_eq!(m.servers[1].last_seen, None);
    }

    #[test]
    fn a_silence_counts_only_when_someone_was_heard_after_its_deadline() {
        let mut m = Membership::new(2, 1);
        let timeout = Duration::from_secs(1);
        let now = Instant::now();
        let old = now - Duration::from_secs(5);
        m.servers[0] = Member {
            last_seen: Some(old),
            ..live("s0:1", 7)
        };
        m.servers[1] = Member {
            last_seen: Some(old - Duration::from_secs(1)),
            ..live("s1:1", 8)
        };
        m.workers[0] = Member {
            last_seen: Some(old),
            ..live("w0", 9)
        };
        // Nobody heard since the deadlines passed: this coordinator is the one cut off.
        let heard = m.last_heard();
        assert_eq!(heard, Some(old));
        assert_eq!(m.server_failure(0, timeout, heard), None);
        assert_eq!(m.server_failure(1, timeout, heard), None);
        // The worker speaks: both servers' silences are theirs.
        m.workers[0].last_seen = Some(now);
        let heard = m.last_heard();
        assert!(m.server_failure(0, timeout, heard).is_some());
        assert!(
            m.server_failure(1, timeout, heard)
                .is_some_and(|w| w.contains("silent for"))
        );
        // A refused probe needs no one else: only a reachable host refuses.
        m.servers[1].refused = true;
        assert!(m.server_failure(1, timeout, None).is_some());
        // Heard from, but within its timeout: not declared.
        m.servers[0].last_seen = Some(now);
        assert_eq!(m.server_failure(0, timeout, Some(now)), None);
    }

    #[test]
    fn a_probe_is_taken_once_and_reaches_only_live_servers() {
        let mut m = Membership::new(2, 1);
        m.servers[1] = live("s1:1", 7);
        assert_eq!(m.take_probe_targets(), None);
        m.probe_requested = true;
        assert_eq!(m.take_probe_targets(), Some(vec![(1, "s1:1".into())]));
        assert_eq!(m.take_probe_targets(), None);
    }
}

//! The two leader faults, from the strike to the standby started again: the leader
//! SIGKILLed, or cut off from every etcd member while it still reaches the job.

use super::{Active, DETECT_WITHIN, LEADER_CUT_SECONDS};
use crate::error::Result;
use crate::soak::cluster::Cluster;
use crate::soak::schedule::FaultKind;

impl Active {
    pub(super) fn advance_leader(
        &mut self,
        cluster: &mut Cluster,
        now: f64,
        since: f64,
        first_progress_after: &dyn Fn(f64) -> Option<f64>,
    ) -> Result<()> {
        let Some((slot, old)) = self.coordinator.clone() else {
            self.record.over = true;
            return Ok(());
        };
        let led = cluster.new_leader_since(&old, self.t0);
        if let Some(t) = led {
            self.record.detect_seconds.get_or_insert(self.rel(t));
            if self.record.resume_seconds.is_none()
                && let Some(r) = first_progress_after(t)
            {
                self.record.resume_seconds = Some(self.rel(r));
            }
        }
        let cut = self.record.kind == FaultKind::LeaderEtcdCut;
        if cut && !self.undone && since >= LEADER_CUT_SECONDS {
            etcd_rules(cluster, &self.hosts[0], false)?;
            self.undone = true;
        }
        if !cut {
            self.undone = true;
        }
        if led.is_none() && since >= DETECT_WITHIN {
            self.record
                .notes
                .push(format!("no new leader within {DETECT_WITHIN} s"));
            if cut && !self.undone {
                etcd_rules(cluster, &self.hosts[0], false)?;
                self.undone = true;
            }
            self.record.over = true;
            return Ok(());
        }
        if led.is_some() && self.undone && !self.repaired {
            let old_proc = cluster.coordinators.iter_mut().find(|c| c.name == old);
            if let Some(p) = old_proc {
                if p.alive() {
                    if since < LEADER_CUT_SECONDS + 10.0 {
                        return Ok(());
                    }
                    self.record
                        .notes
                        .push("the old leader still ran 10 s after the cut healed; killed".into());
                    p.kill();
                } else if cut {
                    self.record.notes.push(format!(
                        "the old leader exited by itself (code {:?})",
                        p.exited
                    ));
                }
            }
            cluster.start_coordinator(slot, true)?;
            self.repaired = true;
        }
        if self.repaired && self.record.resume_seconds.is_some() {
            self.record.redundant_seconds = Some(self.rel(now));
            self.record.over = true;
        }
        Ok(())
    }
}

/// DROP between `host` and every etcd member, both ways, in both namespaces.
pub(super) fn etcd_rules(cluster: &Cluster, host: &str, insert: bool) -> Result<()> {
    let h = cluster.net.host(host).clone();
    for i in 0..3 {
        let e = cluster.net.host(&format!("e{i}")).clone();
        cluster.net.partition(&h, &e, true, true, insert)?;
    }
    Ok(())
}

//! TCP's retransmission floor on the job's connections. A small call (a pull, a 2PC
//! message, a parity update) has one or two packets in flight, too few for a fast
//! retransmit, so a lost packet waits for the retransmission timer, which Linux never
//! sets below 200 ms; a delayed ACK may wait up to 200 ms too. On a link losing 5% of
//! its packets, nearly every step lost one and trained 15x slower (BENCHMARKS [F5]).
//! Linux 6.15 lets a socket lower both (`TCP_RTO_MIN_US`, `TCP_DELACK_MAX_US`), as
//! datacenter stacks do; neither `rustix` nor `socket2` names them yet, hence `libc`.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// From `include/uapi/linux/tcp.h` (Linux 6.15).
const TCP_RTO_MIN_US: libc::c_int = 45;
const TCP_DELACK_MAX_US: libc::c_int = 46;

/// Lowers `socket`'s minimum retransmission timeout and longest delayed ACK to `min`.
pub(crate) fn set(socket: &impl AsRawFd, min: Duration) -> io::Result<()> {
    let us = libc::c_int::try_from(min.as_micros()).unwrap_or(libc::c_int::MAX);
    set_option(socket, TCP_RTO_MIN_US, us)?;
    set_option(socket, TCP_DELACK_MAX_US, us)
}

/// `set`, saying once per process why it could not (a kernel older than 6.15): the
/// kernel's own 200 ms stays, and the job runs as before.
pub(crate) fn tune(socket: &impl AsRawFd, min: Option<Duration>) {
    // A log's dedupe flag, not state: the process says it once, not per connection.
    static SAID: AtomicBool = AtomicBool::new(false);
    let Some(min) = min else {
        return;
    };
    if let Err(e) = set(socket, min)
        && !SAID.swap(true, Ordering::Relaxed)
    {
        tracing::warn!(
            "TCP's minimum retransmission timeout stays the kernel's (200 ms): {e} (needs \
             Linux 6.15+); a lossy link will slow training. Set \
             cluster.deadlines.retransmit_min_ms = 0 to silence this."
        );
    }
}

/// The data segments `socket` has sent in its life and how many were retransmissions
/// (`tcpi_data_segs_out`, `tcpi_total_retrans`): what turns a connection's tail probes on
/// (`tail_probe.rs`).
pub(crate) fn sent(socket: &impl AsRawFd) -> io::Result<crate::tail_probe::Sent> {
    // SAFETY: tcp_info is plain integers, for which all zeroes is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: the descriptor is open for the borrow of `socket`; `info` is a live tcp_info
    // and `len` holds its exact size, so the kernel writes at most that many bytes into it
    // (an older kernel writes fewer, and the rest stays zero).
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(crate::tail_probe::Sent {
        segments: info.tcpi_data_segs_out,
        retransmitted: info.tcpi_total_retrans,
    })
}

/// `socket`'s minimum retransmission timeout, as the kernel rounded it (tests).
#[cfg(test)]
pub(crate) fn rto_min(socket: &impl AsRawFd) -> io::Result<Duration> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: the descriptor is open for the borrow of `socket`; `value` is a live c_int
    // and `len` holds its exact size, so the kernel writes at most that many bytes into it.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            TCP_RTO_MIN_US,
            (&raw mut value).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Duration::from_micros(value.max(0) as u64))
}

fn set_option(socket: &impl AsRawFd, option: libc::c_int, value: libc::c_int) -> io::Result<()> {
    // SAFETY: the descriptor is open for the borrow of `socket`; the kernel reads exactly
    // `size_of::<c_int>()` bytes from `&value`, a live c_int.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            option,
            (&raw const value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

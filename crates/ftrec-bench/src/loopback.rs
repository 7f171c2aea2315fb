//! What this machine's loopback gives: a raw TCP copy between two threads, the ceiling for
//! any rebuild between processes on one host (`bench ec` judges its rebuild rate against
//! it: with `k = 2`, installing a byte means moving two).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use crate::error::{BenchError, Result};

/// Bytes moved per measurement, and per write and read.
const TOTAL: usize = 2 << 30;
const CHUNK: usize = 8 << 20;

fn io(what: &'static str) -> impl Fn(std::io::Error) -> BenchError {
    move |source| BenchError::IoDuring {
        what: what.into(),
        source,
    }
}

/// One copy of `TOTAL` bytes through a loopback socket; bytes per second.
fn once() -> Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(io("loopback: bind"))?;
    let address = listener.local_addr().map_err(io("loopback: address"))?;
    let reader = std::thread::spawn(move || -> std::io::Result<usize> {
        let (mut stream, _) = listener.accept()?;
        let mut buffer = vec![0u8; CHUNK];
        let mut got = 0;
        while got < TOTAL {
            match stream.read(&mut buffer)? {
                0 => break,
                n => got += n,
            }
        }
        Ok(got)
    });
    let mut stream = TcpStream::connect(address).map_err(io("loopback: connect"))?;
    let chunk = vec![0x5au8; CHUNK];
    let started = Instant::now();
    let mut sent = 0;
    while sent < TOTAL {
        stream.write_all(&chunk).map_err(io("loopback: write"))?;
        sent += CHUNK;
    }
    drop(stream);
    let got = reader
        .join()
        .map_err(|_| BenchError::Failed("loopback: the reader panicked".into()))?
        .map_err(io("loopback: read"))?;
    if got != TOTAL {
        return Err(BenchError::Failed(format!(
            "loopback: {got} bytes arrived of {TOTAL}"
        )));
    }
    Ok(TOTAL as f64 / started.elapsed().as_secs_f64())
}

/// The median of three copies, in bytes per second.
pub fn bytes_per_sec() -> Result<f64> {
    let mut rates = (0..3).map(|_| once()).collect::<Result<Vec<f64>>>()?;
    rates.sort_by(f64::total_cmp);
    Ok(rates[1])
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_copy_moves_every_byte_at_a_positive_rate() {
        let rate = super::once().unwrap();
        assert!(rate.is_finite() && rate > 0.0, "{rate}");
    }
}

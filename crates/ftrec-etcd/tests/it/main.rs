//! The etcd client against a real etcd server, one binary: the client and elections
//! (`etcd.rs`), fenced writes (`fenced.rs`).

mod etcd;
mod fenced;

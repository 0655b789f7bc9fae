//! The rendezvous store: a small authenticated key-value server through which ranks find each other.
//!
//! One process (the launcher, or rank 0) runs a [`RendezvousServer`]; every rank talks to it with a
//! blocking [`StoreClient`]. Each connection is authenticated with the job secret
//! ([`crate::transport::handshake`]) before any request is read; a connection that fails is dropped and the
//! server keeps serving everybody else. Operations: `set`, `get` (waits on the server until the key
//! exists), `add` (an atomic integer counter, stored as decimal text) and `delete`.
//!
//! `server` (a tokio runtime serving every connection), `client` (one authenticated connection, one request at
//! a time) and `wire` (the request and response framing they share).

mod client;
mod server;
mod wire;

pub use client::StoreClient;
pub use server::RendezvousServer;
pub use wire::{MAX_KEY_LEN, MAX_VALUE_LEN};

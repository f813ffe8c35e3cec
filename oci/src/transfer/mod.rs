//! Moving images by digest: references, the registry client (auth, TLS), pushes, copies with what refers to them, and attaching artifacts.
pub mod attach;
pub mod auth;
pub mod carry;
pub mod copy;
pub mod endpoint;
pub mod progress;
pub mod push;
pub mod reference;
pub mod referrers;
pub mod remote;
pub mod tls;

//! The generated `retryd.v1` types, clients and servers, from
//! `proto/retryd/v1/retryd.proto` at the repository's root: shared by the
//! server, the tools and any Rust client.
//!
//! Only the server's gRPC edge turns these into domain types; the engine
//! and the budget stores never see them.
#![allow(missing_docs, unreachable_pub, clippy::all)]

tonic::include_proto!("retryd.v1");

/// The encoded descriptor set of `proto/`, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("retryd_descriptor");

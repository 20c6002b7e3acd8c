//! retryd: decides whether a failed outbound call may be tried again.
pub mod auth;
pub mod budget;
pub mod config;
pub mod engine;
pub mod grpc;
pub mod policy;
pub mod telemetry;

pub mod pb {
    //! Generated protobuf and gRPC types.
    #![allow(missing_docs, unreachable_pub, clippy::all)]
    tonic::include_proto!("retryd.v1");
}

//! retryd, the server: decides whether a failed outbound call may be tried
//! again, for every caller of a fleet.
//!
//! The rules are `retryd_engine`'s, the budgets `retryd_budget`'s and the
//! wire types `retryd_proto`'s; this crate is what serves them: the
//! configuration, who may call, the decision pipeline (`decide`), the
//! transport under the gRPC edge, the edge itself, and what calls leave
//! behind (`record`, `telemetry`). `main.rs` wires them together.

pub mod auth;
pub mod build;
pub mod config;
pub mod decide;
pub mod decision_log;
pub mod grpc;
pub mod policy;
pub mod record;
pub mod reload;
pub mod telemetry;
pub mod texts;
pub mod transport;

// The crates this one serves, under the names the code reads best with.
use retryd_budget as budget;
use retryd_engine as engine;
use retryd_proto as pb;

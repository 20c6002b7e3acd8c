//! retryd runs under valgrind, the tool people reach for to profile it
//! (callgrind) or chase a leak (memcheck).
//!
//! It once could not: rustix's raw Linux backend reads the vDSO itself to
//! call `clock_gettime`, and valgrind hides the vDSO, so the memory store's
//! clock crashed the process at start-up (rustix issue #1559). rustix now
//! goes through libc, whose vDSO calls valgrind handles.

use retryd_testkit as support;

use std::time::Duration;

use retryd_proto as pb;
use support::{Server, retryable};

#[tokio::test]
async fn serves_a_decision_under_valgrind() {
    // `--tool=none` runs the program on valgrind's core, which is what
    // breaks a raw vDSO read, without the cost of checking memory.
    let mut server = Server::start_under(&["valgrind", "--tool=none", "--quiet"], "");
    let mut client = server.decider().await;
    let decision = client
        .decide(retryable("payments"))
        .await
        .expect("Decide answers under valgrind")
        .into_inner();
    assert_eq!(decision.verdict(), pb::Verdict::Retry, "{decision:?}");

    let status = server
        .terminate(Duration::from_secs(30))
        .expect("retryd exits on SIGTERM under valgrind");
    assert!(status.success(), "{status:?}\n{}", server.logs());
}

package retryd

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
)

// firstDecisionEnv makes the test binary, run as a child, a process that
// builds a client at its default settings and makes one decision.
const firstDecisionEnv = "RETRYD_GO_FIRST_DECISION_AT"

// TestFirstDecisionIsRetrydsFromProcessStart (issue 38): a fresh process's
// first decision is retryd's, not the fallback's, because New connects
// before it returns. It logs the time from starting the process to that
// decision (the README's number); no ceiling is asserted, a busy machine
// sets it.
func TestFirstDecisionIsRetrydsFromProcessStart(t *testing.T) {
	server := shared(t)
	for i := 0; i < 3; i++ {
		cmd := exec.Command(os.Args[0], "-test.run=^TestHelperFirstDecision$", "-test.count=1")
		cmd.Env = append(os.Environ(), firstDecisionEnv+"="+server.grpc)
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		var line string
		scanner := bufio.NewScanner(stdout)
		for scanner.Scan() {
			if strings.HasPrefix(scanner.Text(), "first decision:") {
				line = scanner.Text()
				break
			}
		}
		elapsed := time.Since(start)
		_ = cmd.Wait()
		if line != "first decision: retryd" {
			t.Fatalf("the child's first decision: %q", line)
		}
		t.Logf("process start to first shared decision: %v", elapsed.Round(time.Millisecond))
	}
}

// TestHelperFirstDecision is the child's side; it does nothing in a normal
// run.
func TestHelperFirstDecision(t *testing.T) {
	addr := os.Getenv(firstDecisionEnv)
	if addr == "" {
		return
	}
	client, err := New(addr, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	d, err := client.Decide(context.Background(), &pb.DecideRequest{Upstream: "go-startup", Idempotency: pb.Idempotency_IDEMPOTENCY_SAFE, Attempt: 1,
		Evidence: pb.Evidence_EVIDENCE_NOT_SENT, Failure: pb.FailureKind_FAILURE_KIND_CONNECT})
	switch {
	case err != nil:
		fmt.Println("first decision: error", err)
	case d.Fallback:
		fmt.Println("first decision: fallback", d.Explanation)
	default:
		fmt.Println("first decision: retryd")
	}
}

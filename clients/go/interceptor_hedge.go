package retryd

import (
	"context"
	"reflect"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// grpcCopy is how one copy of a unary call ended.
type grpcCopy struct {
	err             error
	header, trailer metadata.MD
	peer            peer.Peer
	reply           interface{} // the copy's own reply (hedged calls only)
}

// hedgedGRPC is a hedged first attempt as the interceptor's retry loop sees
// it (see hedgedHTTP).
type hedgedGRPC struct {
	grpcCopy
	sent      int
	decisions []Decision
}

func hedgeCallOf(upstream, operation string, idempotency pb.Idempotency, maxAttempts uint32, lineage string) hedgeCall {
	return hedgeCall{
		upstream: upstream, operation: operation, idempotency: idempotency, maxAttempts: maxAttempts, lineage: lineage,
		body: &pb.Body{Kind: pb.BodyKind_BODY_KIND_ENCODED_VALUE},
	}
}

// grpcHedgePlan says whether the first attempt of a unary call is hedged:
// only with a protobuf reply (APIv2 or APIv1, see messageOf) behind a
// pointer, since every copy needs a reply of its own of the same type, and
// the winner's is merged into the caller's.
func (c *Client) grpcHedgePlan(attempt int, upstream string, idempotency pb.Idempotency, reply interface{}) (hedgePlan, bool) {
	if attempt != 1 {
		return hedgePlan{}, false
	}
	if messageOf(reply) == nil || reflect.TypeOf(reply).Kind() != reflect.Pointer {
		return hedgePlan{}, false
	}
	return c.hedgePlanFor(upstream, idempotency)
}

// grpcDone says whether a copy's ending ends the call: a success, or a
// status that is not a retryable failure ([FailureCodes]).
func grpcDone(err error) bool {
	return err == nil || !FailureCodes[status.Code(err)]
}

// hedgeFirstCall sends a unary call's first attempt and its hedges (see
// runHedged). Losers are cancelled (grpc-go sends RST_STREAM: the server
// sees its context cancelled); the winner's reply is merged into reply.
func (c *Client) hedgeFirstCall(ctx context.Context, plan hedgePlan, send func(context.Context, int, interface{}) grpcCopy, reply interface{}, call hedgeCall, noReporting bool) hedgedGRPC {
	replyType := reflect.TypeOf(reply).Elem()
	sendCopy := func(copyCtx context.Context, copy int) (grpcCopy, bool) {
		own := reflect.New(replyType).Interface()
		out := send(copyCtx, copy+1, own)
		out.reply = own
		return out, grpcDone(out.err)
	}
	decide := func(k, sent int) (Decision, error) {
		return c.DecideHedge(ctx, call.hedgeRequest(ctx, k, sent))
	}
	record := func(r copyResult[grpcCopy]) {
		// As unhedged: a FailureCodes status fails, CANCELLED (the
		// caller's) is neither, any other ending succeeds.
		if code := status.Code(r.result.err); !noReporting && code != codes.Canceled {
			c.recordAttempt(ctx, call.upstream, r.copy+1, !FailureCodes[code], r.elapsed)
		}
	}
	cancelledFirst := func(elapsed time.Duration) {
		if !noReporting && ctx.Err() == nil {
			c.Reporter().RecordLatency(call.upstream, true, elapsed)
		}
	}
	out := runHedged(ctx, plan, sendCopy, decide, record, cancelledFirst, func(grpcCopy) {})
	out.cancel()
	if !noReporting {
		c.recordHedgeWon(ctx, call.upstream, out.won())
	}
	result := out.result
	if result.err == nil {
		into := messageOf(reply)
		proto.Reset(into)
		proto.Merge(into, messageOf(result.reply))
	}
	return hedgedGRPC{grpcCopy: result, sent: out.sent, decisions: out.decisions}
}

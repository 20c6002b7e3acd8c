package retryd

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// The generated contract is committed; this regenerates it and fails if
// anything differs. It needs protoc and protoc-gen-go-grpc on PATH (Debian:
// protobuf-compiler, protoc-gen-go-grpc); protoc-gen-go is built from the
// google.golang.org/protobuf the module builds with, so that its version is
// the one the generated code was made with. The commands are those of
// tools/generate.sh.
func TestGeneratedCodeIsUpToDate(t *testing.T) {
	for _, tool := range []string{"protoc", "protoc-gen-go-grpc"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not on PATH (apt-get install protobuf-compiler protoc-gen-go-grpc): %v", tool, err)
		}
	}
	out := t.TempDir()
	cmd := exec.Command("bash", "tools/generate.sh", out)
	if output, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("tools/generate.sh: %v\n%s", err, output)
	}
	for _, name := range []string{"retryd.pb.go", "retryd_grpc.pb.go"} {
		committed, err := os.ReadFile(filepath.Join("retrydv1", name))
		if err != nil {
			t.Fatal(err)
		}
		fresh, err := os.ReadFile(filepath.Join(out, "retrydv1", name))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(committed, fresh) {
			t.Errorf("retrydv1/%s is stale: run tools/generate.sh and commit the result", name)
		}
	}
}

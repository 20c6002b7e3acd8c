package retryd

import (
	"fmt"
	"go/parser"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// readmeGlue is what the README's Go blocks may use without declaring it:
// the imports a program would have, and, as parameters, the values a
// fragment gets from the blocks before it or from its surroundings.
var readmeImports = map[string]string{
	"context":     `"context"`,
	"fmt":         `"fmt"`,
	"log":         `"log"`,
	"http":        `"net/http"`,
	"time":        `"time"`,
	"grpc":        `"google.golang.org/grpc"`,
	"credentials": `"google.golang.org/grpc/credentials"`,
	"durationpb":  `"google.golang.org/protobuf/types/known/durationpb"`,
	"retryd":      `retryd "github.com/retryd/retryd/clients/go"`,
	"pb":          `pb "github.com/retryd/retryd/clients/go/retrydv1"`,
	// OpenTelemetry is not a dependency: a stub with the two names the
	// README uses, with their signatures.
	"propagation": `"github.com/retryd/retryd/clients/go/_readme/propagation"`,
}

const readmeParams = "ctx context.Context, client *retryd.Client, target string, creds credentials.TransportCredentials"

const propagationStub = `package propagation

import "context"

type MapCarrier map[string]string

type TraceContext struct{}

func (TraceContext) Inject(ctx context.Context, carrier MapCarrier) {}
`

var goBlock = regexp.MustCompile("(?ms)^```go\n(.*?)^```")

// TestReadmeExamplesCompile (issue 38) compiles every Go block of README.md:
// an import block against the glue's imports, an expression as a value, and
// anything else as the body of a function (returning error, so a block may
// return one). A broken example fails the build.
func TestReadmeExamplesCompile(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := goBlock.FindAllStringSubmatch(string(readme), -1)
	if len(blocks) < 6 {
		t.Fatalf("only %d Go blocks found in README.md", len(blocks))
	}
	var funcs strings.Builder
	used := map[string]bool{"context": true, "retryd": true, "credentials": true}
	for i, block := range blocks {
		code := block[1]
		if strings.HasPrefix(code, "import") {
			for _, line := range strings.Split(code, "\n") {
				spec := strings.TrimSpace(strings.SplitN(line, "//", 2)[0])
				if strings.HasPrefix(spec, "import") || spec == ")" || spec == "" {
					continue
				}
				found := false
				for _, glue := range readmeImports {
					found = found || glue == spec
				}
				if !found {
					t.Errorf("README block %d imports %s, which the glue lacks", i+1, spec)
				}
			}
			continue
		}
		for name := range readmeImports {
			if strings.Contains(code, name+".") {
				used[name] = true
			}
		}
		if _, err := parser.ParseExpr(code); err == nil {
			funcs.WriteString(fmt.Sprintf("var readmeBlock%d = %s\n", i+1, code))
		} else {
			funcs.WriteString(fmt.Sprintf("func readmeBlock%d(%s) error {\n%s\nreturn nil\n}\n", i+1, readmeParams, code))
		}
	}
	var file strings.Builder
	file.WriteString("package main\n\nimport (\n")
	for name := range used {
		file.WriteString("\t" + readmeImports[name] + "\n")
	}
	file.WriteString(")\n\nfunc main() {}\n\n" + funcs.String())

	dir := "_readme" // inside the module, for its vendor tree; ./... skips it
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.MkdirAll(filepath.Join(dir, "propagation"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "propagation", "propagation.go"), []byte(propagationStub), 0o644); err != nil {
		t.Fatal(err)
	}
	main := filepath.Join(dir, "readme.go")
	if err := os.WriteFile(main, []byte(file.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("go", "vet", "./"+main).CombinedOutput(); err != nil {
		t.Fatalf("the README's Go blocks do not compile: %v\n%s\n--- generated:\n%s", err, out, file.String())
	}
}

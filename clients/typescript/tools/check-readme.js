#!/usr/bin/env node
// Type-checks every ```ts block of README.md with tsc against the package's
// own sources, so that an example that no longer compiles fails the build.
// Each block is its own ES module (.mts: a fragment may await at the top
// level, as the code around it would; the quick start, which must not, is
// also compiled as CommonJS by check-install.js); the names a fragment uses without defining
// (`retryd`, `log`, `url`, a generated `StockClient`, …) are declared in the
// glue below, and nothing else is added to it.
'use strict';
const { execFileSync } = require('node:child_process');
const fs = require('node:fs');
const path = require('node:path');
const { readmeBlocks } = require('./readme-blocks');

const here = path.resolve(__dirname, '..');
const out = path.join(here, 'dist', 'readme');
fs.rmSync(out, { recursive: true, force: true });
fs.mkdirSync(out, { recursive: true });

const GLUE = `// What README fragments take as given.
import type * as grpc from '@grpc/grpc-js';
import type { RetrydClient } from 'retryd-client';
declare global {
  const retryd: RetrydClient;
  const url: string;
  const init: RequestInit;
  const log: { warn(fields: object, message: string): void; error(fields: object, message: string): void };
  const request: Buffer;
  function newToken(): Promise<string>;
  /** A client class as grpc-js's generated code makes it. */
  const StockClient: new (address: string, credentials: grpc.ChannelCredentials, options?: grpc.ClientOptions) => grpc.Client & {
    Reserve(request: Buffer, options: grpc.CallOptions, callback: grpc.requestCallback<Buffer>): grpc.ClientUnaryCall;
  };
}
export {};
`;
fs.writeFileSync(path.join(out, 'glue.d.ts'), GLUE);
const blocks = readmeBlocks();
const files = blocks.map((block, index) => {
  const name = `block-${String(index + 1).padStart(2, '0')}-line-${block.line}.mts`;
  // `export {}` makes every block a module, so blocks never see each other's names.
  fs.writeFileSync(path.join(out, name), `${block.code}\nexport {};\n`);
  return name;
});
fs.writeFileSync(
  path.join(out, 'tsconfig.json'),
  JSON.stringify(
    {
      compilerOptions: {
        target: 'ES2022',
        lib: ['ES2022', 'DOM'],
        module: 'Node16',
        moduleResolution: 'Node16',
        types: ['node'],
        typeRoots: [path.join(here, 'node_modules', '@types')],
        strict: true,
        noEmit: true,
        skipLibCheck: true,
        baseUrl: here,
        paths: { 'retryd-client': ['src/index.ts'], '*': ['node_modules/*'] },
      },
      files: ['glue.d.ts', ...files],
    },
    null,
    2,
  ),
);
try {
  execFileSync(process.execPath, [require.resolve('typescript/bin/tsc'), '-p', path.join(out, 'tsconfig.json')], { stdio: 'inherit', cwd: here });
} catch {
  console.error(`check-readme: a README example does not compile (files in ${out}, named by their README line)`);
  process.exit(1);
}
console.log(`check-readme: ${blocks.length} TypeScript blocks of README.md type-check`);

#!/usr/bin/env node
// Installs the package the way a project outside this repository does, and
// runs the README's quick start from it (issue 38): `npm pack`, a fresh
// temporary project with a `file:` dependency on the tarball (installed
// --prefer-offline: tarballs from the cache `npm ci` filled, the registry
// asked only for what the cache lacks), and the quick start
// compiled by tsc twice, as CommonJS and as an ES module, each run against
// a real retryd ($RETRYD_BIN). Needs `npm run build` first (dist/).
'use strict';
const { execFileSync } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { readmeBlocks } = require('./readme-blocks');

const here = path.resolve(__dirname, '..');
const npm = process.platform === 'win32' ? 'npm.cmd' : 'npm';
const run = (file, args, options) => execFileSync(file, args, { encoding: 'utf8', ...options });

async function main() {
  const { startRetryd, CLIENT_TEST_CONFIG } = require(path.join(here, 'dist', 'test', 'support.js'));
  const project = fs.mkdtempSync(path.join(os.tmpdir(), 'retryd-ts-install-'));
  const retryd = await startRetryd(CLIENT_TEST_CONFIG);
  try {
    const tarball = run(npm, ['pack', '--silent', '--pack-destination', project], { cwd: here }).trim().split('\n').pop();
    const packed = run('tar', ['-tzf', path.join(project, tarball)]);
    for (const needed of ['package/dist/src/index.js', 'package/dist/src/index.d.ts', 'package/proto/retryd/v1/retryd.proto']) {
      if (!packed.includes(needed)) throw new Error(`${tarball} lacks ${needed}`);
    }
    if (/package\/(src|test)\//.test(packed) || packed.includes('package/dist/test/')) throw new Error(`${tarball} ships sources or tests`);

    fs.writeFileSync(
      path.join(project, 'package.json'),
      JSON.stringify({ name: 'retryd-install-check', private: true, dependencies: { 'retryd-client': `file:./${tarball}` } }, null, 2),
    );
    run(npm, ['install', '--prefer-offline', '--no-audit', '--no-fund', '--loglevel=error'], { cwd: project, stdio: 'inherit' });
    const grpcVersion = JSON.parse(fs.readFileSync(path.join(project, 'node_modules', '@grpc', 'grpc-js', 'package.json'), 'utf8')).version;
    if (grpcVersion !== '1.14.7') throw new Error(`installed @grpc/grpc-js ${grpcVersion}, not the pinned 1.14.7`);

    const quickStart = readmeBlocks().find((block) => block.heading === 'Quick start');
    if (!quickStart) throw new Error('README.md has no ```ts block under "## Quick start"');
    const tsc = require.resolve('typescript/bin/tsc', { paths: [here] });
    for (const type of ['commonjs', 'module']) {
      const dir = path.join(project, type);
      fs.mkdirSync(dir);
      fs.writeFileSync(path.join(dir, 'package.json'), JSON.stringify({ type }));
      fs.writeFileSync(path.join(dir, 'quickstart.ts'), quickStart.code);
      run(process.execPath, [
        tsc, '--strict', '--target', 'ES2022', '--module', 'nodenext', '--moduleResolution', 'nodenext', '--skipLibCheck',
        '--types', 'node', '--typeRoots', path.join(here, 'node_modules', '@types'), path.join(dir, 'quickstart.ts'),
      ], { cwd: dir, stdio: 'inherit' });
      const compiled = fs.readFileSync(path.join(dir, 'quickstart.js'), 'utf8');
      const isCommonJs = compiled.includes('require("retryd-client")');
      if (isCommonJs !== (type === 'commonjs')) throw new Error(`the ${type} build of the quick start is not ${type}`);
      const output = run(process.execPath, [path.join(dir, 'quickstart.js')], { cwd: dir, env: { ...process.env, RETRYD_TARGET: retryd.grpc } });
      // A NON_IDEMPOTENT call that timed out after sending: retryd's rule 8.
      if (!/^AMBIGUOUS by retryd: /.test(output)) throw new Error(`the ${type} quick start printed: ${output}`);
      console.log(`check-install: ${tarball} installed with file:, quick start as ${type}: ${output.trim().split('\n')[0]}`);
    }
  } finally {
    await retryd.stop();
    fs.rmSync(project, { recursive: true, force: true });
  }
}

main().catch((error) => {
  console.error(`check-install: ${error.stack ?? error}`);
  process.exit(1);
});

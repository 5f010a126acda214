// The page of `pkvbench report --html`: renders the JSON document embedded in the page (no request is ever made).
// Every text from the runs is inserted as text (textContent), never parsed as HTML.
(function () {
  "use strict";

  const data = JSON.parse(document.getElementById("pkvbench-data").textContent);
  const samples = data.samples;
  const LIST_LIMIT = 400; // sample buttons drawn at once; the search box narrows a longer list
  const DIFF_LIMIT = 250000; // word pairs compared for the highlighting; longer texts are marked whole

  // --- DOM helpers -------------------------------------------------------------------------------------------------

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "class") node.className = value;
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else node.setAttribute(name, value === true ? "" : value);
    }
    return append(node, children);
  }

  // Append children, nested lists flattened and null, undefined and false left out, as `el` takes them.
  function append(node, ...children) {
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  function formatValue(value, kind) {
    if (value === null || value === undefined) return "—";
    if (kind === "number") return Number(value).toFixed(2);
    return String(value);
  }

  function isFull(policy) {
    return policy.split(":")[0] === "full";
  }

  // --- sortable tables ---------------------------------------------------------------------------------------------

  function sortKey(value, column) {
    const ranks = data.ranks[column];
    return ranks && Object.prototype.hasOwnProperty.call(ranks, value) ? ranks[value] : value;
  }

  function sortedRows(rows, index, column, ascending) {
    const sign = ascending ? 1 : -1;
    return rows.slice().sort((a, b) => {
      if (a[index] === null) return b[index] === null ? 0 : 1; // missing cells last, either way
      if (b[index] === null) return -1;
      const x = sortKey(a[index], column);
      const y = sortKey(b[index], column);
      if (typeof x === "number" && typeof y === "number") return sign * (x - y);
      return sign * String(x).localeCompare(String(y), undefined, { numeric: true });
    });
  }

  function cellClass(column, kind, value) {
    const classes = kind === "text" ? [] : ["num"];
    if (value === null) classes.push("missing");
    else if ((column === "vs full" || column === "delta") && value < 0) classes.push("worse");
    else if ((column === "vs full" || column === "delta") && value > 0) classes.push("better");
    return classes.join(" ");
  }

  function renderTable(table, id) {
    const body = el("tbody");
    const head = el("tr");
    const draw = (rows) =>
      body.replaceChildren(
        ...rows.map((row) =>
          el(
            "tr",
            {},
            row.map((value, i) =>
              el("td", { class: cellClass(table.columns[i], table.kinds[i], value) }, formatValue(value, table.kinds[i])),
            ),
          ),
        ),
      );
    let sorted = -1;
    let ascending = true;
    table.columns.forEach((column, i) => {
      const th = el("th", { scope: "col", class: table.kinds[i] === "text" ? null : "num", title: `Sort by ${column}` }, column);
      th.addEventListener("click", () => {
        ascending = sorted === i ? !ascending : true;
        sorted = i;
        head.querySelectorAll("th").forEach((cell) => cell.removeAttribute("aria-sort"));
        th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
        draw(sortedRows(table.rows, i, column, ascending));
      });
      head.append(th);
    });
    draw(table.rows);
    return el("div", { class: "table-wrap" }, el("table", { class: "data sortable", id }, el("thead", {}, head), body));
  }

  // --- summary tab -------------------------------------------------------------------------------------------------

  // The tables a report has only for some runs: [its key in data.tables, the section it goes in, a heading (null:
  // none, it follows the section's table above), what it shows].
  const OPTIONAL_TABLES = [
    [
      "turns",
      "turns",
      "Accuracy by turn",
      "The conversations' rows (--query-mode multi-turn), as pkvbench report prints them: each cell's score at " +
        "each turn with its 95% interval, the curve of the means from the first turn on, n conversations.",
    ],
    [
      "frontier",
      "frontier",
      "Accuracy per byte",
      "Each cell's mean bytes (kv_bytes; memory: % of the full cache at 16 bits per value), its scores with " +
        "95% intervals, and * on the Pareto front (no cell smaller and at least as good). The figure is in the " +
        "Figures tab.",
    ],
    [
      "memory_diff",
      "frontier",
      null,
      "Per memory target, its best cell against each other cell that fits it, paired on the same samples " +
        "(diff in points, 95% interval, Holm over every comparison); the full cache counts where all its caches fit.",
    ],
  ];

  function renderSummary() {
    if (data.notes.length) {
      document.getElementById("notes").append(el("ul", { class: "notes" }, data.notes.map((note) => el("li", {}, note))));
    }
    document.getElementById("summary-table").append(renderTable(data.tables.summary, "summary-data"));
    document.getElementById("report-table").append(renderTable(data.tables.report, "report-data"));
    for (const [key, section, heading, hint] of OPTIONAL_TABLES) {
      if (data.tables[key]) {
        append(
          document.getElementById(section),
          heading && el("h2", {}, heading),
          el("p", { class: "hint" }, hint),
          renderTable(data.tables[key], `${key.replaceAll("_", "-")}-data`),
        );
      }
    }
    const comparison = data.comparison;
    if (!comparison) return;
    append(
      document.getElementById("comparison"),
      el("h2", {}, "Compared with the paper"),
        el(
          "p",
          { class: "hint" },
          `Measured vs ${comparison.reference} (score × 100; delta = measured − paper), for the cells both have, ` +
            "as pkvbench compare prints it.",
        ),
      comparison.statements.map((statement) => el("p", { class: "hint" }, statement)),
      renderTable(comparison.table, "comparison-data"),
    );
  }

  // --- figures tab (drawn when first shown) ------------------------------------------------------------------------

  const FIGURE_GROUPS = [
    ["curves", "Score vs budget", "no policy other than the full cache"],
    ["frontier", "Accuracy per byte", "no storage bits or memory budgets (--kv-bits, --memory)"],
    ["heatmap", "Needle heatmaps", "no task laid out on a length × depth grid (the needle tasks)"],
    ["layers", "Entries kept per layer", "no row records kv_kept of a compressing policy"],
    ["memory", "Cache size while the answer is written", "no row cut its cache while decoding (--decode-budget)"],
  ];
  let figuresDrawn = false;

  function drawFigures() {
    if (figuresDrawn) return;
    figuresDrawn = true;
    const section = document.getElementById("figures");
    for (const [kind, heading, absent] of FIGURE_GROUPS) {
      const figures = data.figures.filter((figure) => figure.kind === kind);
      const group = el("div", { class: "figure-group" }, el("h2", {}, heading));
      if (!figures.length) group.append(el("p", { class: "empty" }, `None: ${absent} in these runs.`));
      for (const figure of figures) {
        const target = el("div", { class: "vega-target" });
        group.append(
          el("figure", { class: "chart", "data-kind": kind }, el("figcaption", {}, el("strong", {}, figure.title), figure.caption), target),
        );
        vegaEmbed(target, figure.spec, {
          renderer: "svg",
          actions: { export: true, source: false, compiled: false, editor: false }, // the editor is a web site
        })
          .then(() => target.setAttribute("data-rendered", "true"))
          .catch((error) => console.error(`figure "${figure.title}" failed: ${error}`));
      }
      section.append(group);
    }
  }

  // --- samples tab -------------------------------------------------------------------------------------------------

  const taskSelect = document.getElementById("sample-task");
  const filterSelect = document.getElementById("sample-filter");
  const searchBox = document.getElementById("sample-search");
  const list = document.getElementById("sample-list");
  const detail = document.getElementById("sample-detail");
  const severalModels = new Set(samples.configs.map((c) => c.model)).size > 1;
  const severalModes = new Set(samples.configs.map((c) => c.mode)).size > 1;
  let selected = null;

  function sampleHash(sample) {
    return `#samples/${encodeURIComponent(sample.task)}/${encodeURIComponent(sample.id)}`;
  }

  function matchingSamples() {
    const filter = filterSelect.value;
    const query = searchBox.value.trim().toLowerCase();
    return samples.samples.filter(
      (sample) =>
        sample.task === taskSelect.value &&
        (filter === "all" || sample[filter]) &&
        (!query || sample.id.toLowerCase().includes(query) || sample.rows.some((row) => row[1].toLowerCase().includes(query))),
    );
  }

  function fieldsLine(sample) {
    return Object.entries(sample.fields)
      .filter(([name]) => name !== "context_tokens")
      .map(([name, value]) => `${name} ${value}`)
      .join(" · ");
  }

  function scoreRange(sample) {
    const scores = sample.rows.map((row) => row[2]).filter((score) => score !== null);
    if (!scores.length) return "no score";
    return `scores ${Math.min(...scores).toFixed(2)}–${Math.max(...scores).toFixed(2)}`;
  }

  function refreshList() {
    const shown = matchingSamples();
    const inTask = samples.samples.filter((sample) => sample.task === taskSelect.value).length;
    document.getElementById("sample-count").textContent = `${shown.length} of ${inTask} samples`;
    const items = shown.slice(0, LIST_LIMIT).map((sample) =>
      el(
        "li",
        { class: sample === selected ? "selected" : null, "data-sample": sample.id },
        el(
          "button",
          { type: "button", onclick: () => (location.hash = sampleHash(sample)) },
          el("span", { class: "sample-name" }, sample.id),
          sample.disagree ? el("span", { class: "badge disagree", title: "policies predicted different texts" }, "disagree") : null,
          sample.lost ? el("span", { class: "badge lost", title: "a policy scored below the full cache" }, "lost") : null,
          el("span", { class: "sample-meta" }, [fieldsLine(sample), scoreRange(sample)].filter(Boolean).join(" · ")),
        ),
      ),
    );
    if (shown.length > LIST_LIMIT) {
      items.push(el("li", { class: "more" }, `… ${shown.length - LIST_LIMIT} more: narrow the list with Find.`));
    }
    if (!shown.length) items.push(el("li", { class: "more" }, "No sample matches."));
    list.replaceChildren(...items);
  }

  // Words of `text` that are not in the longest common subsequence with `reference`, marked.
  function diffNodes(reference, text) {
    const theirs = reference.split(/\s+/).filter(Boolean);
    const parts = text.split(/(\s+)/);
    const words = parts.filter((part, i) => i % 2 === 0 && part);
    if (theirs.length * words.length > DIFF_LIMIT) return [el("mark", {}, text)];
    const rows = words.length + 1;
    const cols = theirs.length + 1;
    const common = new Uint32Array(rows * cols);
    for (let i = words.length - 1; i >= 0; i--) {
      for (let j = theirs.length - 1; j >= 0; j--) {
        common[i * cols + j] =
          words[i] === theirs[j]
            ? common[(i + 1) * cols + j + 1] + 1
            : Math.max(common[(i + 1) * cols + j], common[i * cols + j + 1]);
      }
    }
    const kept = new Set();
    for (let i = 0, j = 0; i < words.length && j < theirs.length; ) {
      if (words[i] === theirs[j]) {
        kept.add(i);
        i++;
        j++;
      } else if (common[(i + 1) * cols + j] >= common[i * cols + j + 1]) i++;
      else j++;
    }
    let word = 0;
    return parts.map((part, i) => {
      if (i % 2 === 1 || !part) return part;
      return kept.has(word++) ? part : el("mark", {}, part);
    });
  }

  function scoreBadge(score) {
    if (score === null) return el("span", { class: "score" }, "—");
    const hue = Math.round(Math.max(0, Math.min(1, score)) * 120); // red → green, as the needle heatmaps
    return el("span", { class: "score", style: `background: hsl(${hue}, 70%, 86%)` }, score.toFixed(2));
  }

  function predictionsTable(sample) {
    const groupOf = (config) => `${config.model}\u0000${config.mode}`;
    const references = new Map();
    for (const row of sample.rows) {
      const config = samples.configs[row[0]];
      if (isFull(config.policy) && !references.has(groupOf(config))) references.set(groupOf(config), row);
    }
    const head = [
      severalModels ? "model" : null,
      "policy",
      "budget",
      severalModes ? "query mode" : null,
      "kept",
      "score",
      "vs full",
      "prediction",
    ].filter(Boolean);
    const body = sample.rows.map((row) => {
      const config = samples.configs[row[0]];
      const reference = references.get(groupOf(config));
      const [, pred, score, kept] = row;
      const full = isFull(config.policy);
      const same = reference && reference[1].trim() === pred.trim();
      const delta = reference && score !== null && reference[2] !== null && !full ? score - reference[2] : null;
      const text = pred
        ? reference && !full && !same
          ? diffNodes(reference[1], pred)
          : pred
        : el("span", { class: "empty-pred" }, "(empty)");
      return el(
        "tr",
        { class: full ? "reference" : reference ? (same ? "same" : "differs") : null, "data-policy": config.policy, "data-budget": config.budget },
        severalModels ? el("td", {}, config.model) : null,
        el("td", {}, config.policy),
        el("td", { class: "num" }, config.budget),
        severalModes ? el("td", {}, config.mode) : null,
        el("td", { class: "num", title: "entries kept per layer per KV head (mean)" }, kept === null ? "—" : String(kept)),
        el("td", { class: "num" }, scoreBadge(score)),
        el("td", { class: `num ${delta === null ? "missing" : delta < 0 ? "worse" : delta > 0 ? "better" : ""}` }, delta === null ? "" : (delta > 0 ? "+" : "") + delta.toFixed(2)),
        el("td", { class: "pred" }, text),
      );
    });
    return el(
      "div",
      { class: "table-wrap whole" },
      el("table", { class: "data predictions" }, el("thead", {}, el("tr", {}, head.map((name) => el("th", {}, name)))), el("tbody", {}, body)),
    );
  }

  function showSample(sample) {
    selected = sample;
    refreshList();
    const fields = Object.entries(sample.fields);
    detail.replaceChildren();
    append(
      detail,
      el(
        "h3",
        { id: "sample-title" },
        `${sample.task} · ${sample.id}`,
        sample.disagree ? el("span", { class: "badge disagree" }, "policies disagree") : null,
        sample.lost ? el("span", { class: "badge lost" }, "lost points vs full") : null,
      ),
      fields.length ? el("dl", { class: "fields" }, fields.map(([name, value]) => [el("dt", {}, name), el("dd", {}, String(value))])) : null,
      sample.question ? [el("h4", {}, "Question"), el("p", { class: "question" }, sample.question)] : null,
      sample.context
        ? el("details", { class: "context" }, el("summary", {}, `Context excerpt (${sample.context.length} characters)`), el("pre", {}, sample.context))
        : null,
      el("h4", {}, "Answers"),
      sample.answers.length ? el("ul", { class: "answers" }, sample.answers.map((answer) => el("li", {}, el("code", {}, answer)))) : el("p", { class: "empty" }, "none recorded"),
      el("h4", {}, "Predictions"),
      el(
        "p",
        { class: "hint" },
        "Score 0–1; vs full: the score minus the full cache's; highlighted words are not in the full cache's prediction.",
      ),
      predictionsTable(sample),
    );
  }

  function initSamples() {
    for (const task of samples.tasks) {
      const count = samples.samples.filter((sample) => sample.task === task).length;
      taskSelect.append(el("option", { value: task }, `${task} (${count})`));
    }
    for (const [control, event] of [[taskSelect, "change"], [filterSelect, "change"], [searchBox, "input"]]) {
      control.addEventListener(event, () => {
        refreshList();
        selectFirstUnlessShown();
      });
    }
    refreshList();
  }

  // Keep a sample on show: the first of the list when none is, or when the shown one is of another task.
  function selectFirstUnlessShown() {
    if (selected && selected.task === taskSelect.value) return;
    const first = matchingSamples()[0];
    if (first) showSample(first);
  }

  // --- run tab -----------------------------------------------------------------------------------------------------

  function keyValueTable(entries, heading) {
    return el(
      "div",
      { class: "table-wrap" },
      el(
        "table",
        { class: "data" },
        el("thead", {}, el("tr", {}, heading.map((name) => el("th", {}, name)))),
        el("tbody", {}, entries.map(([name, value]) => el("tr", {}, el("td", {}, name), el("td", {}, el("code", {}, typeof value === "string" ? value : JSON.stringify(value)))))),
      ),
    );
  }

  function renderRuns() {
    const section = document.getElementById("run");
    for (const run of data.runs) {
      section.append(
        el(
          "div",
          { class: "run-card" },
          el("h3", {}, el("code", {}, run.folder)),
          el("dl", { class: "fields" }, run.facts.map(([name, value]) => [el("dt", {}, name), el("dd", {}, value)])),
          Object.keys(run.options).length ? [el("h4", {}, "Options"), keyValueTable(Object.entries(run.options), ["option", "value"])] : null,
          Object.keys(run.policies).length ? [el("h4", {}, "Policies"), keyValueTable(Object.entries(run.policies), ["policy", "options"])] : null,
          run.record ? el("details", { class: "record" }, el("summary", {}, "run.json"), el("pre", {}, JSON.stringify(run.record, null, 2))) : null,
        ),
      );
    }
  }

  // --- header, tabs and links (#summary, #figures, #samples/TASK/ID, #run) -------------------------------------------

  function route() {
    const [tab, ...rest] = location.hash.slice(1).split("/");
    const shown = ["summary", "figures", "samples", "run"].includes(tab) ? tab : "summary";
    for (const section of document.querySelectorAll("section.tab")) section.hidden = section.id !== shown;
    for (const link of document.querySelectorAll("#tabs a")) link.classList.toggle("active", link.dataset.tab === shown);
    if (shown === "figures") drawFigures();
    if (shown === "samples" && rest.length >= 2) {
      const task = decodeURIComponent(rest[0]);
      const id = decodeURIComponent(rest.slice(1).join("/"));
      const sample = samples.samples.find((s) => s.task === task && s.id === id);
      if (sample) {
        if (taskSelect.value !== task) taskSelect.value = task;
        showSample(sample);
      }
    }
    if (shown === "samples") selectFirstUnlessShown();
  }

  function renderHeader() {
    document.getElementById("title").textContent = data.title;
    const rows = samples.samples.reduce((total, sample) => total + sample.rows.length, 0);
    document.getElementById("subtitle").textContent =
      `${rows} rows · ${samples.samples.length} samples · ${samples.configs.length} policy × budget configurations · ` +
      `${data.runs.length} run folder${data.runs.length === 1 ? "" : "s"}`;
    document.getElementById("footer").textContent =
      `Made by pkvbench ${data.pkvbench} at ${data.generated} from the run folders alone; ` +
      "figures drawn with Vega-Lite, inlined: the page needs no network.";
  }

  renderHeader();
  renderSummary();
  renderRuns();
  initSamples();
  window.addEventListener("hashchange", route);
  route();
})();

"""deploy.generate through Ray Data: requests from JSONL or Parquet, a file or a folder, a local path
or a URI; results to a JSONL file (written by this driver, in order or not, resumable) or to a folder
or URI that Ray Data writes (JSONL, or Parquet when the name ends in .parquet). `--replicas N` runs N
independent pipelines, one per actor of a Ray Data actor pool, all fed by the one stream, as Ray Data
LLM's processors run one engine per actor.

Rows read through Ray Data have no line numbers, so each needs its own "id"; one without gets an
error line with a null id.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time

import pyarrow as pa
import pyarrow.fs
import ray.data
from ray.data.datasource import BlockBasedFileDatasink
from tqdm import tqdm

from raymoe.deploy.results_file import ResultWriter, id_key, local_jsonl, parse_line
from raymoe.stages.errors import RaymoeError
from raymoe.stages.text.answers import split_chat_result

# A Parquet output's columns: nested values (logprobs, tool_calls) as their JSON text, the id as text.
RESULT_FIELDS = ("id", "prompt_token_ids", "token_ids", "text", "reasoning_content", "tool_calls", "finish_reason",
                 "prompt_tokens", "completion_tokens", "logprobs", "prompt_logprobs", "error")


def run(args, engine_args, defaults: dict, check_signals) -> int:
    from raymoe.cluster.engine import connect_ray  # here, not above: see Replica
    from raymoe.stages.files.loader import open_model, resolve_model_path

    open_model(resolve_model_path(args.model), args.max_model_len)     # a bad model fails here, not in a replica
    input_is_dir = check_input(args.input)
    parquet_in = args.input_format == "parquet" or (args.input_format == "auto" and is_parquet(args.input))
    to_file = local_jsonl(args.output)
    if args.resume and not to_file:
        raise RaymoeError("--resume needs a JSONL file output (a folder that Ray Data writes cannot be resumed)")
    if to_file:
        writer = ResultWriter(args.output, args.resume)
    else:
        check_output_folder(args.output)
        writer = None
    try:
        connect_ray(args.replicas * args.pp * (1 + args.ep))     # keeps the caller's signal handlers
        context = ray.data.DataContext.get_current()
        context.execution_options.preserve_order = args.ordered
        context.enable_progress_bars = sys.stderr.isatty()
        logging.getLogger("ray.data").setLevel(logging.WARNING)     # not a line per dataset on stderr
        if parquet_in:
            ds = ray.data.read_parquet(args.input).map_batches(rows_to_lines, batch_format="pyarrow")
        else:
            extensions = ["jsonl", "json"] if input_is_dir else None
            ds = ray.data.read_text(args.input, file_extensions=extensions).rename_columns({"text": "line"})
        # blocks of --window rows, so that every replica gets work even from one small file
        ds = ds.repartition(target_num_rows_per_block=args.window)
        ds = ds.map_batches(Replica, batch_size=args.window, batch_format="pyarrow", num_cpus=0,
                            compute=ray.data.ActorPoolStrategy(size=args.replicas),
                            fn_constructor_kwargs=dict(engine_args=engine_args, defaults=defaults,
                                                       done=writer.done if writer else set()))
        start = time.perf_counter()
        transports = set()       # what each replica's pipeline moves activations over (`auto` picks per pipeline)
        if writer is not None:
            count = write_rows(ds, writer, check_signals, transports)
            summary = f"{count} requests"
        else:
            if args.output.rstrip("/").endswith(".parquet"):
                ds.map_batches(results_table, batch_format="pyarrow").write_parquet(args.output)
            else:
                ds.write_datasink(JsonlSink(args.output))
            summary = "results written"
    except ray.exceptions.RayError as e:      # a replica's or a Ray Data task's failure
        raise RaymoeError(f"the Ray Data job failed: {cause(e)}") from None
    finally:
        if writer is not None:
            writer.close()
    print(f"{summary} in {time.perf_counter() - start:.2f} s to {args.output}; {args.replicas} replica(s), "
          f"pp={args.pp} ep={args.ep} transport={'/'.join(sorted(transports)) or args.transport}", file=sys.stderr)
    return 0


def is_parquet(path: str) -> bool:
    path = path.rstrip("/")
    if path.endswith(".parquet"):
        return True
    return os.path.isdir(path) and any(name.endswith(".parquet") for name in os.listdir(path))


def check_input(path: str) -> bool:
    """Before any work: the input exists and can be read. Returns whether it is a folder."""
    try:
        fs, inner = pyarrow.fs.FileSystem.from_uri(path) if "://" in path else (pyarrow.fs.LocalFileSystem(),
                                                                                os.path.abspath(path))
        info = fs.get_file_info(inner)
    except Exception as e:        # unknown scheme, no credentials, unreachable store: pyarrow says which
        raise RaymoeError(f"{path}: cannot read input ({first_line(e)})") from None
    if info.type == pyarrow.fs.FileType.NotFound:
        raise RaymoeError(f"{path}: cannot read input (not found)")
    if "://" not in path and not os.access(path, os.R_OK):
        raise RaymoeError(f"{path}: cannot read input (permission denied)")
    return info.type == pyarrow.fs.FileType.Directory


def check_output_folder(path: str):
    """Before any work: the output folder exists (created if missing) and can be written."""
    try:
        if "://" in path:
            fs, inner = pyarrow.fs.FileSystem.from_uri(path)
            fs.create_dir(inner, recursive=True)
        else:
            os.makedirs(path, exist_ok=True)
            if not os.access(path, os.W_OK):
                raise PermissionError("permission denied")
    except Exception as e:
        raise RaymoeError(f"{path}: cannot write output ({first_line(e)})") from None


def cause(error: BaseException) -> str:
    """The raymoe error inside Ray's wrappers, else the last line of what Ray says."""
    e, seen = error, set()
    while e is not None and id(e) not in seen:
        if isinstance(e, RaymoeError):
            return str(e)
        seen.add(id(e))
        e = getattr(e, "cause", None) or e.__cause__
    lines = str(error).strip().splitlines()
    return lines[-1] if lines else type(error).__name__


def first_line(e: Exception) -> str:
    text = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return text.strip().splitlines()[0]


def rows_to_lines(table):
    """Parquet rows as the JSONL lines they stand for (a null column is an absent field)."""
    lines = [json.dumps({k: v for k, v in row.items() if v is not None}) for row in table.to_pylist()]
    return pa.table({"line": pa.array(lines, pa.string())})


class Replica:
    """One pipeline (its own coordinator and stage actors) generating the batches Ray Data hands it."""

    def __init__(self, engine_args, defaults: dict, done: set[str]):
        # imported here: Ray Data's read and map workers load this module, and need no torch
        from raymoe.cluster.engine import ClusterEngine

        self.engine = ClusterEngine(engine_args)
        self.defaults, self.done = defaults, done
        self.transport = self.engine.stats()["transport"]     # what `auto` picked here, for the driver's summary

    def __call__(self, table):
        results, good = [], []
        for line in table.column("line").to_pylist():
            rid, request, error = parse_line(line, None)
            if rid is not None and id_key(rid) in self.done:
                continue
            results.append({"id": rid, "error": error} if error else None)
            if error is None:
                good.append((len(results) - 1, rid, request))
        in_flight, chats = {}, {}
        for (i, rid, request), outcome in zip(good, self.engine.submit_many([(r, q) for _, r, q in good],
                                                                             self.defaults)):
            if isinstance(outcome, dict):
                results[i] = {"id": rid, "error": outcome["error"]}
            else:
                in_flight[outcome] = i
                if "messages" in request:
                    chats[outcome] = request     # its reasoning (and tool calls) go apart from its text
        while in_flight:
            for seq_id, result in self.engine.wait_finished(timeout=1.0):
                if seq_id in chats:
                    result = split_chat_result(result, self.engine.tokenizer, chats.pop(seq_id))
                results[in_flight.pop(seq_id)] = result
        return pa.table({"result": pa.array([json.dumps(r, ensure_ascii=False) for r in results], pa.string()),
                         "transport": pa.array([self.transport] * len(results), pa.string())})


def write_rows(ds, writer: ResultWriter, check_signals, transports: set[str]) -> int:
    """The driver writes each result as Ray Data yields it; a repeated id stops the job. Adds the transports
    the replicas used to `transports`."""
    seen, count = set(), 0
    with tqdm(desc="generating", unit="req", file=sys.stderr, disable=None) as bar:
        for row in ds.iter_rows():
            check_signals()
            result = json.loads(row["result"])
            transports.add(row["transport"])
            if result["id"] is not None:
                key = id_key(result["id"])
                if key in seen:
                    raise RaymoeError(f"the id {key} is repeated in the input: ids must be unique (--resume finds "
                                      f"finished lines by id); the results before it were written")
                seen.add(key)
            writer.write(result)
            count += 1
            bar.update(1)
    return count


def results_table(table):
    """Result lines as Parquet columns (RESULT_FIELDS)."""
    rows = [json.loads(line) for line in table.column("result").to_pylist()]
    columns = {name: [] for name in RESULT_FIELDS}
    for r in rows:
        usage = r.get("usage") or {}
        rid = r["id"]
        values = {**r, "id": rid if rid is None or isinstance(rid, str) else json.dumps(rid),
                  "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
                  "logprobs": json.dumps(r["logprobs"]) if r.get("logprobs") is not None else None,
                  "tool_calls": (json.dumps(r["tool_calls"], ensure_ascii=False) if r.get("tool_calls") is not None
                                 else None),
                  "prompt_logprobs": json.dumps(r["prompt_logprobs"]) if r.get("prompt_logprobs") is not None else None}
        for name in RESULT_FIELDS:
            columns[name].append(values.get(name))
    schema = pa.schema([("id", pa.string()), ("prompt_token_ids", pa.list_(pa.int64())),
                        ("token_ids", pa.list_(pa.int64())), ("text", pa.string()), ("reasoning_content", pa.string()),
                        ("tool_calls", pa.string()), ("finish_reason", pa.string()),
                        ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
                        ("logprobs", pa.string()), ("prompt_logprobs", pa.string()), ("error", pa.string())])
    return pa.table(columns, schema=schema)


class JsonlSink(BlockBasedFileDatasink):
    """Result lines exactly as the JSONL file job writes them, one file per block."""

    def __init__(self, path: str):
        super().__init__(path, file_format="jsonl")

    def write_block_to_file(self, block, file):
        for line in block.to_arrow().column("result").to_pylist():
            file.write((line + "\n").encode("utf-8"))

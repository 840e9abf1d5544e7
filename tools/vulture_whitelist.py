"""Names vulture reports as unused (at ``--min-confidence 60``) that something does use.

``nox -s lint`` runs vulture over ``packages/*/src``, ``tests``, ``examples``,
``benchmarks`` and ``tools`` together with this file (config: ``[tool.vulture]`` in the
root pyproject), so a name used only by the tests or an example counts as used. vulture
reads this file as code that uses the names in it: a bare ``name`` covers a variable,
argument, function or class, ``_.name`` an attribute or method.

Add an entry only for a real false positive (read by a protocol, a framework or
reflection) with a comment saying who reads it; delete dead code instead of listing it.
tests/tooling/test_tooling_vulture.py checks that every entry has a comment and still
names something in the code.
"""

# ruff: noqa: B018, F821

# --- protocols and signatures fixed by someone else ---
pytest_configure  # tests/conftest.py: a pytest hook, called by pytest by name
pytest_unconfigure  # tests/conftest.py: a pytest hook, called by pytest by name
pytest_ignore_collect  # tests/conftest.py: a pytest hook, called by pytest by name
extra_args  # core_array GradientTransformationLike.update(**extra_args): Optax's update signature
element  # data MapTransform/FilterTransform/...(element): the abstract method's documented parameter
_.connection_made  # serving _http / benchmarks/serving: asyncio.Protocol callbacks the event loop calls
_.connection_lost  # serving _http / benchmarks/serving: asyncio.Protocol callback, called by the event loop
_.data_received  # serving _http / benchmarks/serving: asyncio.Protocol callback, called by the event loop
objtype  # nn descriptor __get__(self, obj, objtype=None): Python's descriptor protocol passes it
_.num_feature_axes  # nn RNN cells: documented cell API (Flax's RNNCellBase.num_feature_axes), read by users' code

# --- read by reflection ---
preemption_received_at  # checkpoint logging step_statistics: Orbax's statistics schema, emitted through asdict
synchronous  # checkpoint logging step_statistics: Orbax's statistics schema, emitted through asdict
checkpoint_manager_start_time  # checkpoint logging step_statistics: a field, read through dataclasses.asdict
event_type  # checkpoint logging step_statistics: a dataclass field, read through dataclasses.asdict by the loggers
checkpointer_duration_secs  # checkpoint logging step_statistics: a field, read through dataclasses.asdict by the loggers
checkpoint_manager_duration_secs  # checkpoint logging step_statistics: a field, read through dataclasses.asdict
_.wait_for_prev_duration_secs  # checkpoint _orbax_manager: a statistics field the loggers read through asdict
_.get_old_steps_duration_secs  # checkpoint _orbax_manager: a statistics field the loggers read through asdict
_.checkpointer_blocking_start_time  # checkpoint _orbax_manager: a statistics field the loggers read through asdict
_.checkpointer_blocking_duration_secs  # checkpoint _orbax_manager: a statistics field the loggers read through asdict
_.checkpoint_manager_blocking_duration_secs  # checkpoint _orbax_manager: a statistics field read through asdict
_.time_between_consecutive_saves_sec  # checkpoint _orbax_manager: a statistics field the loggers read through asdict
_.checkpointer_start_time  # checkpoint _orbax_manager: a statistics field the loggers read through asdict
_.checkpointer_duration_secs  # checkpoint _orbax_manager: a statistics field the loggers read through asdict
_.checkpoint_manager_duration_secs  # checkpoint _orbax_manager: a statistics field the loggers read through asdict
_.np_random_map  # data transforms.TfRandomMap: Grain's abstract method, defined by users' subclasses
_.pytest_collection_modifyitems  # tools/compat_suites.py Recorder: a pytest hook, called by pytest
_.pytest_collection_finish  # tools/compat_suites.py Recorder: a pytest hook, called by pytest
_.pytest_collectreport  # tools/compat_suites.py Recorder: a pytest hook, called by pytest
_.pytest_runtest_logstart  # tools/compat_suites.py Recorder: a pytest hook, called by pytest
_.pytest_runtest_logreport  # tools/compat_suites.py Recorder: a pytest hook, called by pytest
_.pytest_runtest_logfinish  # tools/compat_suites.py Recorder: a pytest hook, called by pytest
location  # tools/compat_suites.py: pytest passes hooks their documented (nodeid, location) arguments
_.pre_tokenizer  # tests/llm fixtures: a tokenizers.Tokenizer property, read by its Rust side
_.normalizer  # tests/llm fixtures: a tokenizers.Tokenizer property, read by its Rust side
_.post_processor  # tests/llm fixtures: a tokenizers.Tokenizer property, read by its Rust side
_.__wrapped__  # nn initializers: inspect.signature / functools.unwrap read the wrapped initializer
_.tree_flatten_with_keys  # tests/core_array: JAX calls it on registered pytree classes
_.python_tracer_level  # nn.Profiler: a jax.profiler.ProfileOptions field, read by the profiler's C++ side
IMPLEMENTATION  # cairn.kernels GPU kernel modules: kernels.deferred reads module.IMPLEMENTATION on first use
_.handle_starttag  # tests of _repr_html_: html.parser.HTMLParser calls it
_.handle_endtag  # tests of _repr_html_: html.parser.HTMLParser calls it
makeExtension  # tools/md_docstrings.py: Python-Markdown imports the extension module and calls it
_.extendMarkdown  # tools/md_docstrings.py: Python-Markdown calls it on each extension

# --- names that document a value ---
PAD  # examples/lm/lm_task.py: names token id 0, the padding that eval_batch's zero-filled arrays hold

# --- tests ---
_.lock  # tests/data Unpicklable: the lock is there to make the exception unpicklable
_.blocks_are_accounted_for  # tests/serving PagedCacheMachine: a hypothesis @invariant, run by the state machine
_.lookup  # tests/serving PagedCacheMachine: a hypothesis @rule, run by the state machine
_.shared_blocks_hold_the_same_prefix  # tests/serving PagedCacheMachine: a hypothesis @invariant, run by the state machine
_.teardown  # tests/serving PagedCacheMachine: hypothesis calls RuleBasedStateMachine.teardown after each run
TestPagedCacheStateMachine  # tests/serving: the state machine's unittest TestCase, collected by pytest
_.graph_mode  # cairn.nn: the graph-mode stack (Flax NNX's set_graph_mode), read through getattr
_.get_raw_value  # cairn.nn: Variable.get_raw_value, Flax NNX's public API (tests/nn/test_nn_flax_api.py)
_._helper  # tests/tooling/test_tooling_docargs.py: a private method in the fixture module docargs must skip, read by inspect
_.pad_id  # benchmarks/_posttrain_tunix.py: Tunix's tokenizer protocol, called by Tunix's sampler
_.bos_id  # benchmarks/_posttrain_tunix.py: Tunix's tokenizer protocol, called by Tunix's sampler
_.eos_id  # benchmarks/_posttrain_tunix.py: Tunix's tokenizer protocol, called by Tunix's sampler
_.create_directories_asynchronously  # cairn.checkpoint AsyncOptions: Orbax's option field, accepted and documented
_.barrier_sync_key_prefix  # cairn.checkpoint MultiprocessingOptions: Orbax's option field, accepted and documented
_.skip_sync_file_validations  # cairn.checkpoint FileOptions: Orbax's option field, accepted and documented
_.enable_background_delete  # cairn.checkpoint CheckpointManagerOptions: Orbax's option field, accepted
_.file_options  # cairn.checkpoint CheckpointManagerOptions: Orbax's option field, accepted
_.is_saving_in_progress  # cairn.checkpoint CheckpointManager: Orbax's public method, called by users' code
TextSave  # tests/checkpoint: registered by its decorator, looked up by the handler registry
_.get_current_operation_id  # tools/compat_suites.py: Orbax's test helpers call it on the stub
_.next_operation_id  # tools/compat_suites.py: Orbax's test helpers call it on the stub
__instancecheck__  # tools/compat_suites.py: Python calls it for isinstance against the stand-in class
__subclasscheck__  # tools/compat_suites.py: Python calls it for issubclass against the stand-in class
_._environment  # tools/compat_suites.py: read by Orbax's test helpers through the stub

"""Stage 8's server: an OpenAI-compatible HTTP API in front of the stage's engine, in four kinds of
process.

    launch.py              start the processes, handshake, watchdog, shutdown
    api_server.py          FastAPI app (main process); engine_client.py its end of the sockets;
                           protocol.py request bodies; openai_serving.py response bodies
    tokenizer_worker.py    chat template, tokenization, validation
    scheduler_process.py   the Scheduler in a loop (run_scheduler)
    detokenizer_worker.py  token ids -> text deltas
    messages.py            what they send each other
"""

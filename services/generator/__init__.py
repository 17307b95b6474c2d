"""Accuracy-aware adapter generation (VaLoRA §4.2): offline, CPU-friendly, torch.

    datasets.py   vision tasks built from data shipped in packages (sklearn digits + synthetic)
    user_datasets.py  datasets a user brings (image folder, JSONL), validated; packed for a job
    model.py      the frozen base Qwen2-VL with LoRA slots; what a task head reads
    training.py   TorchTrainer: LoRA + per-task heads trained jointly on cached image features;
                  text tasks (no head) on their answer tokens
    answers.py    a text task's score: SQuAD/VQA-normalised exact match of generated answers
    fusion.py     the greedy fusion algorithm with rollback, and the fusion order chosen from
                  interference probes (pure; `Trainer` protocol)
    bundle.py     export to the valora bundle format (services/common/adapter_format.py)
    pipeline.py   strategies compared, thresholds, registration through the SDK, results file
    __main__.py   `python -m services.generator generate ...`
    demo.py       what `valora demo` serves: pretrained base + greedy-fused adapters, cached per settings
    demo_workload.py  what `valora demo` does with them: registration, the mixed workload, its rows
    pretrain.py   brief pretraining of the base on real images (a stand-in for a pretrained LMM)
    runner.py     `python -m services.generator serve`: runs the store's PENDING generation jobs

Serving contract for a generated head (what workers must compute to reproduce the measured
accuracy): the request is the task's prompt with one image in Qwen2-VL's chat format (default
system turn; user turn = image then prompt; then `<|im_start|>assistant\\n`); the adapter's
LoRA is applied to every q,k,v,o,gate,up,down projection of the language model with scale
lora_alpha / r; the head reads the final-norm hidden state of the last prompt token;
label = labels[argmax(W h + b)]. Prompts are in each bundle directory's manifest and in the
registered Task's description.

Serving contract for a generated text task (datasets.TEXT, VQA-style; no head): the same
request and LoRA, asked as plain TEXT generation with the task's adapter (a Task registered with
no head; `valora infer --task T --prompt QUESTION --image ...`, or the SDK's
`infer(question, [image], task=T, max_new_tokens=N)`), greedy (temperature 0), up to the
manifest's `max_new_tokens[T]` (also in the Task's description), stopping at <|im_end|>; the
answer is the decoded text, right when its normalised form (answers.py: lowercase, no
punctuation or articles) equals the reference's.
"""

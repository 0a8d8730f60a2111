# issue: https://github.com/huggingface/accelerate/issues/2690
# summary: the save runs under `if accelerator.is_main_process:` and wait_for_everyone() only in the else branch: the main process never reaches the barrier and the GPUs hang
# family: collective under a rank guard
from accelerate import Accelerator


def save(accelerator: Accelerator, model, tokenizer, output_dir):
    if accelerator.is_main_process:
        unwrapped_model = accelerator.unwrap_model(model)
        state_dict = accelerator.get_state_dict(model)
        unwrapped_model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(output_dir)
    else:
        accelerator.wait_for_everyone()  # expect: collective-under-rank-guard
